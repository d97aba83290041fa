"""GPT-OSS: what moeflow knows about the family, and its shape from a config.

Every layer is MoE, with a softmax router with a bias and biased experts; attention sinks, alternating
sliding-window and full attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import all_moe_fields, get, mask_kinds
from moeflow.families.family import SOFTMAX, Family


def gpt_oss_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(get(f, "attention_bias", default=True))
    return all_moe_fields(f, "num_local_experts") | {
        "qkv_bias": bias,
        "o_bias": bias,
        "sinks": True,
        "expert_bias": True,
        "router_bias": True,
        # transformers' GptOssConfig alternates sliding-window and full layers when layer_types is not given
        "attention_masks": 2 if f.get("sliding_window") and not f.get("layer_types") else mask_kinds(f, None),
    }


def read_v4_gpt_oss(block, router, args, output):
    """transformers 4.57 GPT-OSS: the router returns dense (T, E) scores (softmax over the chosen
    logits, zero elsewhere) and the index."""
    import torch.nn.functional as F

    scores, index = output
    hidden = args[0].reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden, router.weight, router.bias)
    return logits, index, scores.gather(1, index)


GPT_OSS = Family(
    "gpt_oss",
    "GptOssMLP",
    "router",
    SOFTMAX,
    read_v4_gpt_oss,
    gpt_oss_shape,
    gate_up_fused_v4=True,
    experts_one_tensor_v4=True,
    mask_per_layer_type=True,
    masks_without_positions_v5=True,
)
