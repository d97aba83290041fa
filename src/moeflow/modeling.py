"""Build a model from config or load a pretrained folder, the same way in every stage."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from . import compat


class ModelError(ValueError):
    """A model that cannot be built or loaded, with what to do about it."""


def _impl_kwargs(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"attn_implementation": model_cfg.get("attn_implementation", "sdpa")}
    experts = model_cfg.get("experts_implementation")
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


def load_model(path: str | os.PathLike, model_cfg: Mapping[str, Any] | None = None, dtype: Any = None):
    """Load a local pretrained folder with ``from_pretrained`` (never the hub: offline mode is set)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_cfg = model_cfg or {}
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model folder {path} has no config.json: point 'model.pretrained' at a folder made by save_pretrained"
        )
    return AutoModelForCausalLM.from_pretrained(
        path,
        torch_dtype=dtype or torch.float32,
        trust_remote_code=bool(model_cfg.get("trust_remote_code", False)),
        local_files_only=True,
        **_impl_kwargs(model_cfg),
    )


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
