"""Build a model from config or load a pretrained folder, the same way in every stage, and save one."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import compat
from .config import MODEL_SCHEMA, with_defaults
from .files import atomic_dir, read_json
from .lora import is_lora_model, merge_and_save


class ModelError(ValueError):
    """A model that cannot be built or loaded, with what to do about it."""


def model_section(model_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``model`` section with the schema's defaults for the keys it leaves out (a stage gets the whole
    section; tests and benchmarks may give a few keys, or none to load a folder as it is)."""
    return with_defaults(model_cfg or {}, MODEL_SCHEMA)


def _impl_kwargs(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    model_cfg = model_section(model_cfg)
    kwargs: dict[str, Any] = {"attn_implementation": model_cfg["attn_implementation"]}
    experts = model_cfg["experts_implementation"]
    if experts:
        compat.require_transformers_v5("model.experts_implementation")
        kwargs["experts_implementation"] = experts
    return kwargs


def build_config(model_cfg: Mapping[str, Any], vocab_size: int | None = None):
    """A transformers config from the ``model.config`` mapping (``model_type`` plus the family's keys)."""
    from transformers import AutoConfig

    fields = dict(model_cfg["config"])
    model_type = fields.pop("model_type")
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise ModelError(f"config key 'model.config.model_type': {exc}") from None


def build_model(model_cfg: Mapping[str, Any], vocab_size: int, seed: int = 0):
    """A freshly initialised causal LM from config (deterministic for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(model_cfg, vocab_size)
    torch.manual_seed(seed)
    kwargs = _impl_kwargs(model_cfg)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **kwargs)


# Weight files that are Python pickles: loading one can run arbitrary code, so moeflow never does.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def check_model_folder(path: str | os.PathLike) -> Path:
    """A folder made by ``save_pretrained`` with safetensors weights, or a ModelError saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelError(
            f"model folder {path} does not exist: point 'model.pretrained' at a local folder made by save_pretrained"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model folder {path} has no config.json: point 'model.pretrained' at a folder made by save_pretrained"
        )
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
        found = (
            f"it holds pickle weights ({', '.join(pickles)}), which "
            if pickles
            else "it has no weights; pickle weights "
        )
        raise ModelError(
            f"model folder {path} has no safetensors weights: {found}moeflow refuses to load because unpickling can "
            "run code. Convert the model to safetensors (save_pretrained(..., safe_serialization=True)) "
            "from a source you trust"
        )
    return path


def _remote_code_error(path: Path, exc: Exception) -> ModelError | None:
    if "trust_remote_code" not in str(exc):
        return None
    return ModelError(
        f"model folder {path} needs custom code from the folder (config.json auto_map) "
        "and model.trust_remote_code is off: "
        "moeflow does not run a model's own Python unless the config says so for that model. If you trust it, set "
        "model.trust_remote_code: true next to model.pretrained (the verification report records it)"
    )


def load_model(path: str | os.PathLike, model_cfg: Mapping[str, Any] | None = None, dtype: Any = None):
    """Load a local pretrained folder with ``from_pretrained`` (never the hub: offline mode is set), from
    safetensors only, running the folder's own code only if ``model.trust_remote_code`` is on."""
    import torch
    from transformers import AutoModelForCausalLM

    model_cfg = model_section(model_cfg)
    path = check_model_folder(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            path,
            torch_dtype=dtype or torch.float32,
            trust_remote_code=model_cfg["trust_remote_code"],
            local_files_only=True,
            use_safetensors=True,
            **_impl_kwargs(model_cfg),
        )
    except ValueError as exc:
        remote = _remote_code_error(path, exc)
        if remote is None:
            raise
        raise remote from None


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ModelError(
            f"tokenizer folder {path} does not exist: "
            "it is the model folder ('model.pretrained') or one the pipeline trained"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        remote = _remote_code_error(path, exc)
        if remote is None:
            raise
        raise remote from None


def check_vocabulary(
    model: Any, data_dirs: Sequence[str | os.PathLike], model_path: str | os.PathLike = "the model"
) -> None:
    """Refuse data tokenized with a tokenizer that has more tokens than the model has embedding rows
    (a model may have more rows than tokens: vocabularies are often padded)."""
    rows = model.get_input_embeddings().num_embeddings
    for folder in data_dirs:
        manifest = Path(folder) / "manifest.json"
        tokenizer = (read_json(manifest).get("tokenizer") or {}) if manifest.is_file() else {}
        size = tokenizer.get("vocab_size")
        if size is not None and int(size) > rows:
            raise ModelError(
                f"tokenizer/model mismatch: {folder} was tokenized with a tokenizer of {size} tokens, but {model_path} "
                f"has {rows} embedding rows. Use the model's own tokenizer (model.pretrained brings it) or a model "
                "whose vocabulary covers the tokenizer"
            )


def save_final_model(model: Any, tokenizer: Any, folder: str | os.PathLike) -> None:
    """A folder that AutoModelForCausalLM/AutoTokenizer.from_pretrained load (LoRA adapters merged in); atomic."""
    if is_lora_model(model):
        model.config.use_cache = True
        merge_and_save(model, tokenizer, folder)
        return
    with atomic_dir(folder) as out:
        write_model_folder(model, tokenizer, out)


def write_model_folder(model: Any, tokenizer: Any, folder: str | os.PathLike) -> None:
    """save_pretrained (safetensors) of the model and its tokenizer into an existing folder."""
    model.config.use_cache = True  # a saved model generates with a cache; training turned it off
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
