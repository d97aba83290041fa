"""Step-3.5-Flash's published routing keys: the ones moeflow computes as published, and the values it refuses.

The published config.json carries routing keys that transformers' ``Step3p7TextConfig`` keeps as plain
attributes and its modules never read. moeflow.model.families.step3p5 honours ``norm_expert_weight`` (false: the
chosen experts' sigmoid scores are their weights, not renormalised to sum 1). The others have one value moeflow
computes; another value would train a model with other routing than a serving engine runs, so it is refused
at config check (moeflow.workflow.checks) and when the model is built, naming the key. Standard library only:
the config check reads it while Snakemake builds the DAG.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
