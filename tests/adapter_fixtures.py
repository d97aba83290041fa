"""Adapters saved on each stack, kept in tests/fixtures/adapters/<stack>/<family>/, for the other stack's loader.

A stack cannot write the other stack's adapter (transformers 4.57 names every expert's module, transformers 5 fuses
them), so each stack's adapters are written by that stack and kept: ``python tests/adapter_fixtures.py`` in a
stack's environment rewrites its own. Each holds what moeflow.model.lora.save_adapter writes for a tiny base
model, and the logits that stack computes with the adapter (``logits.safetensors``). The base model is
stack-independent: :func:`write_base` writes a folder in the published layout from seeded values by name, which
both stacks load alike. tests/unit/test_adapter_layout.py checks that a stack still writes its fixtures and that it
loads the other stack's with every expert.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
from tiny_models import COMMON, FAMILY_CONFIGS, VOCAB

from moeflow.loading.factory import make_model
from moeflow.model import lora
from moeflow.model.saved_names import saved_format
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.settings import LoraSettings

FIXTURES = Path(__file__).parent / "fixtures" / "adapters"
# qwen3_moe: the common names; mixtral: w1/w3/w2 in block_sparse_moe on 4.57, mlp on 5, its router trained too;
# deepseek_v3: shared experts and a dense first layer beside the routed experts (what peft's own conversion drops).
# Each with its router mode.
FAMILIES = {"qwen3_moe": "frozen", "mixtral": "trainable", "deepseek_v3": "trainable"}
STACKS = ("pinned", "current")
INPUT = (torch.arange(24) * 7 % VOCAB).reshape(2, 12)  # the same tokens on both stacks


def this_stack() -> str:
    return "current" if compat.is_transformers_v5() else "pinned"


def settings_of(family: str) -> LoraSettings:
    return typed(LoraSettings, {"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["all"], "router": FAMILIES[family]})


def config_of(family: str) -> dict:
    """The family's tiny model (tests/tiny_models.py), untied: a tied output layer is no part of what is tested."""
    return {"model_type": family, **COMMON, **FAMILY_CONFIGS[family], "vocab_size": VOCAB, "tie_word_embeddings": False}


def write_base(folder: Path, family: str) -> Path:
    """A base model folder in the published layout: every tensor this stack's files hold, seeded by its name."""
    from safetensors.torch import save_file

    config = config_of(family)
    settings = {"config": config, "attn_implementation": "eager", "experts_implementation": STACK_DEFAULT_EXPERTS}
    built = make_model(typed(ModelSettings, settings), vocab_size=VOCAB)
    written = saved_format(built, {k: v for k, v in built.state_dict().items()})
    tensors = {}
    for name in sorted(written):  # seeded by name: a stack that has more tensors (MTP layers) has the same others
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        scale = 1.0 if name.endswith("norm.weight") else 0.2
        tensors[name] = (scale * torch.randn(written[name].shape, generator=generator)).contiguous()
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * tensors[name]
        if name.endswith("e_score_correction_bias"):
            # DeepSeek-V3 on transformers 4.57 scores the experts of the groups it leaves out 0.0 (5: -inf), so with
            # a negative score one of them can be chosen there only; the stacks agree on scores above 0
            tensors[name] = tensors[name].abs()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return folder


def load_base(folder: Path):
    """The base model from its folder, as a run loads a pretrained model (fp32, eager)."""
    settings = {"config": {}, "attn_implementation": "eager", "experts_implementation": STACK_DEFAULT_EXPERTS}
    return make_model(typed(ModelSettings, settings), folder=folder)


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=INPUT, use_cache=False).logits


def write_adapter(base_folder: Path, family: str, out: Path) -> None:
    """This stack's adapter for ``family`` (every trainable tensor drawn, seeded in name order) and the logits it
    gives."""
    from safetensors.torch import save_file

    model = lora.apply_lora(load_base(base_folder), settings_of(family), gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.requires_grad:  # adapters replaced (peft draws their start from the global generator)
                draw = 0.1 * torch.randn(param.shape, generator=generator)
                param.copy_(draw) if "lora_" in name else param.add_(draw)
    out.mkdir(parents=True, exist_ok=True)
    lora.save_adapter(model, out)
    (out / "README.md").unlink()  # peft's model card: nothing a loader reads
    save_file({"logits": logits(model)}, str(out / "logits.safetensors"))


def main(argv: list[str]) -> None:
    import tempfile

    stack = this_stack()
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            out = FIXTURES / stack / family
            for old in out.glob("*"):
                old.unlink()
            write_adapter(write_base(Path(tmp) / family, family), family, out)
            print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
