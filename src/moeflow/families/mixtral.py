"""Mixtral: what moeflow knows about the family, and its shape from a config.

Every layer is MoE, with a softmax router (4.57: an ``nn.Linear`` gate, always renormalised).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeflow.families.config_fields import all_moe_fields
from moeflow.families.family import SOFTMAX, Family, read_linear_gate


def mixtral_shape(f: Mapping[str, Any]) -> dict[str, Any]:
    return all_moe_fields(f, "num_local_experts")


MIXTRAL = Family("mixtral", "MixtralSparseMoeBlock", "gate", SOFTMAX, read_linear_gate, mixtral_shape)
