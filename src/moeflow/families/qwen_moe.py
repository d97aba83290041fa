"""Qwen2-MoE and Qwen3-MoE: what moeflow knows about the families, and their shapes from a config.

A softmax router (4.57: an ``nn.Linear`` gate), MoE every ``decoder_sparse_step`` layers except ``mlp_only_layers``;
Qwen2-MoE adds a shared expert behind a sigmoid gate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import attention_fields, get
from moeflow.families.family import SOFTMAX, Family, read_linear_gate


def _moe_layers(f: Mapping[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    step = int(get(f, "decoder_sparse_step", default=1))
    dense = set(get(f, "mlp_only_layers", default=[]) or [])
    return tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)


def _shared_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    """The fields qwen2_moe and qwen3_moe share: attention, dense FFN, experts and where they are."""
    base = attention_fields(f)
    experts = int(get(f, "num_experts"))
    return base | {
        "dense_ffn": int(get(f, "intermediate_size")),
        "moe_layers": _moe_layers(f, base["num_layers"], experts),
        "num_experts": experts,
        "top_k": int(get(f, "num_experts_per_tok")),
        "expert_ffn": int(get(f, "moe_intermediate_size")),
    }


def qwen3_moe_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    return _shared_fields(f) | {
        "qkv_bias": bool(get(f, "attention_bias", default=False)),
        "o_bias": bool(get(f, "attention_bias", default=False)),
        "qk_norm": "head",
    }


def qwen2_moe_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    return _shared_fields(f) | {
        "shared_ffn": int(get(f, "shared_expert_intermediate_size")),
        "shared_gate": True,
        "qkv_bias": bool(get(f, "qkv_bias", default=True)),
    }


# With no MoE layer (num_experts 0: every layer a dense MLP of intermediate_size) the model is Qwen3's or Qwen2's,
# under the same weight names: the export writes it as that architecture (moeflow.checkpoint.dense_export).
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", SOFTMAX, read_linear_gate, qwen3_moe_shape, dense_model_type="qwen3"
)


QWEN2_MOE = Family(
    "qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", SOFTMAX, read_linear_gate, qwen2_moe_shape, dense_model_type="qwen2"
)
