"""Advice for a copied recipe: its flags translated into moeflow's keys, or refused.

The recipe is the widely copied MoE fine-tuning recipe (HF Trainer arguments and the like); a refusal says what
moeflow does instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def recipe_flag_advice(flag: str, value: Any) -> str | None:
    """What a flag of the copied recipe's expert-parallel launch (``torchrun ... --moe_expert_parallel_degree 2
    --moe_token_dispatcher_type balance --moe_eval_capacity_factor 1.2``, ``group_experts_by: device``)
    becomes in moeflow, or why it is refused; None for any other key. None of these flags exists in
    transformers or accelerate."""
    name = flag.lstrip("-").lower().replace("-", "_")
    text = str(value).lower().replace("-", "").replace("_", "")
    if name == "moe_expert_parallel_degree":
        return (
            f"'{flag}' is not a transformers flag; "
            "expert parallelism is transformers 5's DistributedConfig(ep_size=...): "
            f"use parallel: {{strategy: ep, ep_size: {value}}} (transformers 5 / STACK=current only)"
        )
    if name == "moe_token_dispatcher_type":
        if text in ("alltoall", "alltoallseq"):
            return f"'{flag}: {value}' is parallel.ep_implementation: all_to_all (transformers 5's token exchange)"
        if text == "allgather":
            return (
                f"'{flag}: {value}' is refused: its transformers equivalent, parallel.ep_implementation: all_reduce, "
                "needs ep_size equal to the tensor-parallel size, and moeflow runs no tensor parallelism; remove it "
                "(moeflow exchanges the tokens with all_to_all, the same maths)"
            )
        return (
            f"'{flag}: {value}' is refused: moeflow's expert parallelism dispatches tokens with all_to_all "
            "(parallel.ep_implementation), and no dispatcher balances load; load balancing is the "
            "global-batch balancing loss (train.balance)"
        )
    if name == "moe_eval_capacity_factor":
        return (
            f"'{flag}' is refused: transformers' MoE layers are dropless (every token reaches its top-k experts, "
            "in training and evaluation), so there is no capacity to set: remove it"
        )
    if name == "group_experts_by":
        if text == "device":
            return (
                f"'{flag}: {value}' is what expert parallelism does: use parallel: {{strategy: ep, ep_size: N}} "
                "(transformers 5 places num_experts / N experts on each device)"
            )
        return (
            f"'{flag}: {value}' is refused: experts are grouped by device under expert parallelism "
            "(parallel.ep_size), nothing else"
        )
    return None


def translate_recipe_flags(flags: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The copied recipe's expert-parallel flags as moeflow config overrides (the ``parallel`` section), and
    the refusals (with the reason) for flags that have no equivalent."""
    parallel: dict[str, Any] = {}
    refused: list[str] = []
    for flag, value in flags.items():
        name = flag.lstrip("-").lower().replace("-", "_")
        text = str(value).lower().replace("-", "").replace("_", "")
        if name == "moe_expert_parallel_degree":
            if int(value) > 1:
                parallel |= {"strategy": "ep", "ep_size": int(value)}
        elif name == "moe_token_dispatcher_type" and text in ("alltoall", "alltoallseq"):
            parallel["ep_implementation"] = "all_to_all"
        elif name == "group_experts_by" and text == "device":
            parallel.setdefault("strategy", "ep")
        else:
            refused.append(recipe_flag_advice(flag, value) or f"'{flag}' is not a moeflow or transformers setting")
    return ({"parallel": parallel} if parallel else {}), refused


# Names from a widely copied MoE fine-tuning recipe that exist in neither transformers nor accelerate.
COPIED_RECIPE_NAMES = {
    "adamw_moe": "there is no optimizer 'adamw_moe'; use train.optimizer: adamw (AdamW with parameter groups: "
    "train.router_lr_multiplier, train.freeze_router, no weight decay on norms and biases)",
    "datacollatorformoe": "there is no 'DataCollatorForMoE'; moeflow packs documents with per-document attention "
    "(moeflow.data.collate), with no padding to max_length: remove the setting",
    "accumulate_gradient": "'Trainer.accumulate_gradient' does not exist; set train.grad_accum_steps (losses are "
    "normalised over the whole step) and train.balance.mode for the balancing loss across micro-batches",
    "global_batch_size": "there is no global batch size to set (so no micro-batch that fails to divide it): the "
    "global batch is train.micro_batch_size x train.grad_accum_steps x the ranks (parallel.nproc_per_node x "
    "parallel.nnodes); set those",
    "cosine_with_warmup": "there is no scheduler 'cosine_with_warmup' to choose: moeflow always warms up linearly "
    "(train.warmup_steps or train.warmup_ratio) and then decays with a cosine to train.min_lr",
}


def copied_recipe_problems(cfg: Any, path: str = "") -> list[str]:
    """Keys or values anywhere in the config that name things the copied recipe invented."""
    problems: list[str] = []
    items = cfg.items() if isinstance(cfg, Mapping) else enumerate(cfg) if isinstance(cfg, list) else []
    for key, value in items:
        where = (
            f"{path}.{key}"
            if path and not isinstance(key, int)
            else f"{path}[{key}]"
            if isinstance(key, int)
            else str(key)
        )
        advice = recipe_flag_advice(key, value) if isinstance(key, str) else None
        if advice:  # the recipe's expert-parallel flags: the real setting, or why there is none
            problems.append(f"config key '{where}': {advice}")
            continue
        for name in (key, value):
            if isinstance(name, str):
                for bad, advice in COPIED_RECIPE_NAMES.items():
                    if bad in name.lower().replace("trainer.", ""):
                        problems.append(f"config key '{where}': {advice}")
        problems += copied_recipe_problems(value, where)
    return problems
