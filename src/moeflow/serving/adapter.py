"""A LoRA run's adapter in the layout serving engines read, and whether vLLM's own adapter loader reads it whole.

moeflow saves an adapter as peft does on the training stack (moeflow.model.lora.save_adapter). On transformers 5 the
routed experts' adapters are one rank-r adapter per expert over a fused tensor (peft ``target_parameters``), which
vLLM 0.32 refuses for Qwen3-MoE unless started in a mixed mode. vLLM's MoE LoRA reads one adapter per expert and
projection under the model files' names (``mlp.experts.<e>.gate_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1``)
and stacks them into its fused w13 and w2 itself. The serving adapter is that: every fused adapter split by expert,
exactly, at rank r (moeflow.model.adapter_layout.split_fused, which needs no model here); an adapter saved on
transformers 4.57 is in that layout already. A trainable router is no LoRA a serving engine applies: such a run has
no serving adapter (serve its merged model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from moeflow.model.adapter_layout import PEFT_PREFIX, PIECES_FILE, split_fused
from moeflow.model.lora import SETTINGS_FILE
from moeflow.runtime.files import atomic_dir, read_json, write_json

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def serving_weights(adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter's tensors with every fused routed-expert adapter split into one adapter per expert module."""
    from safetensors.torch import load_file

    folder = Path(adapter_dir)
    return split_fused(load_file(str(folder / ADAPTER_FILE)), folder, None)


def adapted_modules(weights: dict[str, torch.Tensor]) -> list[str]:
    """The modules an adapter's tensors adapt (``model.layers.0.mlp.experts.3.up_proj``), sorted."""
    return sorted({key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for key in weights if ".lora_" in key})


def write_serving_adapter(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """The serving adapter of ``adapter_dir`` (a moeflow LoRA adapter) written whole into ``out_dir``: its tensors
    (:func:`serving_weights`), a peft config whose ``target_modules`` are the adapted modules' names and which has
    no ``target_parameters``, and moeflow's LoRA settings (moeflow.model.lora.load_adapter loads it on either stack).
    Returns what it wrote: modules, expert modules, rank and alpha."""
    from safetensors.torch import save_file

    folder = Path(adapter_dir)
    weights = {key: value.contiguous() for key, value in serving_weights(folder).items()}
    modules = adapted_modules(weights)
    config = read_json(folder / CONFIG_FILE)
    config["target_modules"] = sorted({module.rsplit(".", 1)[-1] for module in modules})
    config["target_parameters"] = None
    with atomic_dir(out_dir) as tmp:
        save_file(weights, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, config)
        write_json(tmp / SETTINGS_FILE, read_json(folder / SETTINGS_FILE))
    experts = [m for m in modules if ".experts." in m]
    return {
        "modules": len(modules),
        "expert_modules": len(experts),
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "split_from_fused": (folder / PIECES_FILE).is_file(),
    }


def engine_read_differences(
    serving_dir: str | os.PathLike, engine: dict[str, Any], read: dict[str, torch.Tensor]
) -> list[str]:
    """Every way vLLM's adapter loader (moeflow.serving.engine's ``--adapter``: ``engine`` its record, ``read`` the
    factors it holds, ``<module>.lora_a`` and ``.lora_b``) did not read the serving adapter at ``serving_dir`` as
    written: a module it lacks, a factor that differs, a scaling other than alpha / r. Empty: read whole."""
    weights = serving_weights(serving_dir)
    config = read_json(Path(serving_dir) / CONFIG_FILE)
    problems = []
    if engine["scaling"] != config["lora_alpha"] / config["r"]:
        problems.append(f"scaling {engine['scaling']}, not lora_alpha / r = {config['lora_alpha'] / config['r']}")
    for module in adapted_modules(weights):
        name = engine["names"].get(module)
        if name is None:
            problems.append(f"{module}: not read")
            continue
        for factor in ("A", "B"):
            mine, theirs = weights[f"{PEFT_PREFIX}{module}.lora_{factor}.weight"], read[f"{name}.lora_{factor.lower()}"]
            if mine.shape != theirs.shape or not torch.equal(mine.float(), theirs.float()):
                problems.append(f"{module}: lora_{factor} read as {tuple(theirs.shape)}, written {tuple(mine.shape)}")
    return problems
