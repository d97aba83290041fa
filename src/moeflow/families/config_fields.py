"""Reading a model config's fields for the planner's shape: the helpers every family's shape reader shares.

A config is a plain mapping (``model.config``, or a folder's config.json); moeflow.plan.shapes turns the fields into
its Shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigFieldError(ValueError):
    """A model config without a field its family's shape needs (the planner raises it as its PlanError)."""


_MISSING = object()


def get(fields: Mapping[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of ``keys`` present (and not null) in ``fields``; an error naming them if none is."""
    for key in keys:
        if fields.get(key) is not None:
            return fields[key]
    if default is _MISSING:
        raise ConfigFieldError(
            f"config key 'model.config.{keys[0]}' is required for model_type {fields.get('model_type')!r}"
            + (f" (also read as: {', '.join(keys[1:])})" if len(keys) > 1 else "")
        )
    return default


def attention_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's size and its attention heads, as every family names them."""
    hidden = int(get(f, "hidden_size"))
    heads = int(get(f, "num_attention_heads"))
    return {
        "hidden_size": hidden,
        "num_layers": int(get(f, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(get(f, "num_key_value_heads", "num_attention_groups", default=heads)),
        "head_dim": int(get(f, "head_dim", default=hidden // heads)),
        "tie_word_embeddings": bool(get(f, "tie_word_embeddings", default=False)),
    }


def all_moe_fields(f: Mapping[str, Any], experts_key: str) -> dict[str, Any]:
    """mixtral, granitemoe, olmoe, gpt_oss: every layer is MoE and ``intermediate_size`` is the expert width."""
    base = attention_fields(f)
    return base | {
        "dense_ffn": 0,
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": int(get(f, experts_key)),
        "top_k": int(get(f, "num_experts_per_tok")),
        "expert_ffn": int(get(f, "intermediate_size")),
    }


def mask_kinds(f: Mapping[str, Any], num_layers: int | None) -> int:
    """The attention types of the main layers (config layer_types: full, sliding window): one mask each."""
    return len(set(list(f.get("layer_types") or [])[:num_layers])) or 1
