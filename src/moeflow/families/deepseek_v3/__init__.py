"""DeepSeek-V3: what moeflow knows about the family, and its shape from a config.

Multi-head latent attention, a sigmoid router with a correction bias choosing group-limited, dense first layers,
shared experts and MTP layers (moeflow.families.mtp). The model class with its MTP layers and a float32 router is in
:mod:`.modeling` (it imports transformers' modelling code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import attention_fields, get
from moeflow.families.family import SIGMOID, Family

MODEL_TYPE = "deepseek_v3"


def deepseek_v3_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    base = attention_fields(f)
    first_dense = int(get(f, "first_k_dense_replace", default=0))
    expert_ffn = int(get(f, "moe_intermediate_size"))
    q_lora = get(f, "q_lora_rank", default=None)
    mtp = int(get(f, "num_nextn_predict_layers", default=0))  # MoE layers with their own embedding
    return base | {
        "mtp_heads": (base["num_heads"],) * mtp,
        "mtp_moe": (True,) * mtp,
        "mtp_embedding": True,
        "attention": "mla",
        "dense_ffn": int(get(f, "intermediate_size")),
        "moe_layers": tuple(range(first_dense, base["num_layers"])),
        "num_experts": int(get(f, "n_routed_experts")),
        "top_k": int(get(f, "num_experts_per_tok")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(get(f, "n_shared_experts", default=0)) * expert_ffn,
        "q_lora_rank": int(q_lora) if q_lora is not None else None,
        "kv_lora_rank": int(get(f, "kv_lora_rank")),
        "qk_nope_head_dim": int(get(f, "qk_nope_head_dim")),
        "qk_rope_head_dim": int(get(f, "qk_rope_head_dim")),
        "v_head_dim": int(get(f, "v_head_dim")),
        "attention_bias": bool(get(f, "attention_bias", default=False)),
    }


def read_v4_deepseek(block, router, args, output):
    """transformers 4.57 DeepSeek-V3: the router returns (index, weights) only; the logits are its
    linear map of the same input, recomputed as the router computes it (float32, autocast off: the hook runs
    outside the router's own autocast-off block, :class:`.modeling.DeepseekV3Router`)."""
    import torch
    import torch.nn.functional as F

    index, weights = output
    hidden = args[0].reshape(-1, router.weight.shape[1])
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.float(), router.weight.float())
    return logits, index, weights


DEEPSEEK_V3 = Family(MODEL_TYPE, "DeepseekV3MoE", "gate", SIGMOID, read_v4_deepseek, deepseek_v3_shape, mtp=True)
