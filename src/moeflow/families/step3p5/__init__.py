"""Step-3.5-Flash: what moeflow knows about the family, its shape from a config, and the routing keys it refuses.

Model type ``step3p5``: transformers 5's step3p7 decoder, with moeflow's causal LM in :mod:`.modeling` (it imports
transformers' modelling code; transformers 5 only). Query heads per layer type,
sliding-window and full layers, a sigmoid router whose block scales the experts' sum after them, a shared expert
per MoE layer, a head-wise attention gate, MTP layers (moeflow.families.mtp).

The published config.json carries routing keys that transformers' ``Step3p7TextConfig`` keeps as plain
attributes and its modules never read. :mod:`.modeling` honours ``norm_expert_weight`` (false: the chosen experts'
sigmoid scores are their weights, not renormalised to sum 1). The others have one value moeflow computes; another
value would train a model with other routing than a serving engine runs, so it is refused at config check
(moeflow.workflow.checks) and when the model is built, naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import ConfigFieldError, attention_fields, get
from moeflow.families.family import SIGMOID, Family

MODEL_TYPE = "step3p5"


HONOURED = ("norm_expert_weight",)

# key -> (the value moeflow computes, what that value means)
FIXED: dict[str, tuple[Any, str]] = {
    "moe_router_activation": ("sigmoid", "sigmoid router scores"),
    "use_moe_router_bias": (True, "the expert-choice bias (moe.router_bias)"),
    "need_fp32_gate": (True, "the router computed in float32"),
}


def routing_key_problems(config: Mapping[str, Any], where: str) -> list[str]:
    """The published routing keys of a step3p5 ``config`` (config.json's keys) that moeflow cannot honour, each
    naming the key, its value, what moeflow computes and what to do; ``where`` names the config."""
    return [
        f"{where}: key {key!r} is {config[key]!r}, but moeflow's Step-3.5 computes {meaning} ({key}: "
        f"{value!r}) and would train other routing than the published code runs: use a model whose config.json "
        f"has {key}: {value!r}"
        for key, (value, meaning) in FIXED.items()
        if key in config and config[key] != value
    ]


def _mtp_types(f: Mapping[str, Any], key: str, mtp_key: str, n: int, m: int) -> list | None:
    """The MTP layers' entries of a per-layer list: transformers' split-off ``mtp_*`` list, or the tail of a
    list with ``n + m`` entries (the published config's, and this key's in moeflow's configs)."""
    if not m:
        return []
    if f.get(mtp_key) is not None:
        return list(f[mtp_key])
    value = f.get(key)
    return list(value[n : n + m]) if isinstance(value, list) and len(value) == n + m else None


def step3p5_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    """Step-3.5-Flash, from transformers 5's Step3p7TextConfig keys or the published config's legacy ones: query
    heads per layer type (``num_sliding_attention_heads``, or the legacy ``attention_other_setting``'s, on
    sliding-window layers), the MTP layers (``num_nextn_predict_layers``, their types after the main layers')."""
    base = attention_fields(f)
    n = base["num_layers"]
    m = int(get(f, "num_nextn_predict_layers", default=0))
    other = f.get("attention_other_setting") or {}
    sliding_heads = int(
        get(f, "num_sliding_attention_heads", default=other.get("num_attention_heads", base["num_heads"]))
    )
    layer_types = list(f.get("layer_types") or ["full_attention"] * n)[:n]
    mtp_types = _mtp_types(f, "layer_types", "mtp_layer_types", n, m)
    if mtp_types is None:  # transformers' default for a config without per-layer types
        mtp_types = ["full_attention"] * m
    if f.get("mlp_layer_types"):
        kinds = list(f["mlp_layer_types"])
        mtp_kinds = _mtp_types(f, "mlp_layer_types", "mtp_mlp_layer_types", n, m)
    else:
        if f.get("moe_layers_enum") is not None:
            enum = f["moe_layers_enum"]
            items = enum.split(",") if isinstance(enum, str) else enum
            moe = {int(x) for x in items if str(x).strip()}
        else:
            moe = set(range(3, n))  # transformers' default: layers 0-2 dense
        kinds = ["sparse" if i in moe else "dense" for i in range(n + m)]
        mtp_kinds = kinds[n:]
    if mtp_kinds is None:
        raise ConfigFieldError(
            f"config key 'model.config.mlp_layer_types': num_nextn_predict_layers is {m}, so it needs {n + m} entries "
            "(the main layers, then the MTP layers), or give mtp_mlp_layer_types"
        )
    moe_layers = tuple(i for i, kind in enumerate(kinds[:n]) if kind == "sparse")
    heads_of = lambda kind: sliding_heads if kind == "sliding_attention" else base["num_heads"]  # noqa: E731
    gating = f.get("gating", True)
    per_head = gating is True or gating == "per-head"
    expert_ffn = int(get(f, "moe_intermediate_size"))
    layer_heads = tuple(heads_of(kind) for kind in layer_types)
    return base | {
        "dense_ffn": int(get(f, "intermediate_size")),
        "moe_layers": moe_layers,
        "num_experts": int(get(f, "n_routed_experts", "moe_num_experts", "num_local_experts")),
        "top_k": int(get(f, "num_experts_per_tok", "moe_top_k")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(get(f, "share_expert_dim", "share_expert_dims", default=expert_ffn)),
        "qkv_bias": bool(get(f, "attention_bias", default=False)),
        "o_bias": bool(get(f, "attention_bias", default=False)),
        "qk_norm": "head",
        # gate outputs per query head (one gate per head), or per head dimension; 0: no gate
        "head_gate": (1 if per_head else base["head_dim"]) if gating else 0,
        "layer_heads": layer_heads if len(set(layer_heads)) > 1 else (),
        "mtp_heads": tuple(heads_of(kind) for kind in mtp_types),
        "mtp_moe": tuple(kind == "sparse" for kind in mtp_kinds),
    }


def read_v5_scaled_after(block, router, args, output):
    """transformers 5 (step3p7's block): the router returns the chosen experts' weights and the block multiplies
    the experts' sum by ``routed_scaling_factor``: the weights the experts really get are their product."""
    logits, weights, index = output
    return logits, index, weights * block.routed_scaling_factor


STEP3P5 = Family(
    MODEL_TYPE,
    "Step3p7SparseMoeBlock",
    "gate",
    SIGMOID,
    None,
    step3p5_shape,
    read_v5=read_v5_scaled_after,
    current_stack_only=True,
    flash_attention=False,  # its attention sets _supports_flash_attn = False: refused at config check, not at load
    mtp=True,
    config_problems=routing_key_problems,
    mask_per_layer_type=True,
)


# transformers 5's own step3p7 decoder (its multimodal model's): routing read alike, not planned.
STEP3P7 = dataclasses.replace(
    STEP3P5,
    model_type="step3p7",
    shape=None,
    current_stack_only=False,
    flash_attention=True,
    mtp=False,
    config_problems=None,
    mask_per_layer_type=False,
)
