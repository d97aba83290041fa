"""OLMoE: what moeflow knows about the family, and its shape from a config.

Every layer is MoE, with a softmax router (4.57: an ``nn.Linear`` gate); q/k norms over all heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import all_moe_fields, get
from moeflow.families.family import SOFTMAX, Family, read_linear_gate


def olmoe_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(get(f, "attention_bias", default=False))
    return all_moe_fields(f, "num_experts") | {"qk_norm": "full", "qkv_bias": bias, "o_bias": bias}


OLMOE = Family("olmoe", "OlmoeSparseMoeBlock", "gate", SOFTMAX, read_linear_gate, olmoe_shape)
