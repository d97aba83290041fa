"""What moeflow knows about one model family, as one record.

The record says how the family's routers are read, how its config gives the planner's shape, and what the stack and
the config check must know about it. Every family module (``qwen_moe``, ``mixtral``, ``granitemoe``, ``olmoe``,
``gpt_oss``, ``deepseek_v3``, ``step3p5``) defines its :class:`Family` records; moeflow.families.registry collects
them. Standard library only at import: the config check reads the records while Snakemake builds the DAG, so a
reader imports torch when a model runs, not before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SOFTMAX = "softmax"


SIGMOID = "sigmoid"


# Config attributes that name an expert count: a model that has one but no family is an MoE moeflow cannot read.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


# A router reader: (MoE block, router module, the router's forward args, its output) -> (logits [T, E], chosen
# expert index [T, k], gate weights [T, k]), read from what the model computed.
Reader = Callable[[Any, Any, tuple, Any], tuple]


# A shape reader: the config's fields -> the planner's Shape fields (moeflow.plan.shapes.Shape).
ShapeReader = Callable[[Mapping[str, Any]], dict[str, Any]]


def read_v5_router(block, router, args, output):
    """transformers 5: every router returns (logits, top-k weights, top-k index)."""
    logits, weights, index = output
    return logits, index, weights


def read_linear_gate(block, router, args, output):
    """transformers 4.57 qwen2_moe/qwen3_moe/mixtral/olmoe: the gate is an nn.Linear returning logits and
    the block takes softmax, top-k and (optionally) renormalises. Repeats the block's operations exactly."""
    import torch
    import torch.nn.functional as F

    logits = output
    hidden = args[0]
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, index = torch.topk(weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):  # mixtral's block always renormalises and has no flag
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, index, weights.to(hidden.dtype)


@dataclass(frozen=True)
class Family:
    """One model type's entry.

    Routing (moeflow.model.routing): ``block_class``, the class name of the MoE block (one per MoE decoder layer);
    ``router_attr``, the block's attribute holding the router module to hook; ``scoring``, softmax or sigmoid; the
    reader on transformers 4.57 (``read_v4``; None: the family is not in 4.57) and on 5 (``read_v5``).
    Planning (moeflow.plan.shapes): ``shape`` (None: the planner refuses the type). The stack and the config check:
    ``current_stack_only`` (transformers 5 only), ``flash_attention`` (its attention supports flash-attn),
    ``mtp`` (moeflow builds its MTP layers, moeflow.families.mtp), ``config_problems`` (published config
    keys moeflow cannot honour, each naming the key; ``where`` names the config). The experts' layout on
    transformers 4.57 (on 5 every family's are fused 3-D parameters, gate and up projections in one
    ``gate_up_proj``): ``gate_up_fused_v4`` (so on 4.57 too), ``experts_one_tensor_v4`` (one tensor for all the
    experts, under other names). Packed rows (moeflow.data.collate): ``mask_per_layer_type`` (its decoder takes a
    dict {layer type: mask}), ``masks_without_positions_v5`` (transformers 5's mask builders are not given its
    position_ids, so moeflow builds its masks). Export (moeflow.checkpoint.dense_export): ``dense_model_type``, the
    dense architecture a config of this type with no MoE layer is written as (None: the family has none)."""

    model_type: str
    block_class: str
    router_attr: str
    scoring: str
    read_v4: Reader | None
    shape: ShapeReader | None
    read_v5: Reader = read_v5_router
    current_stack_only: bool = False
    flash_attention: bool = True
    mtp: bool = False
    config_problems: Callable[[Mapping[str, Any], str], list[str]] | None = None
    gate_up_fused_v4: bool = False
    experts_one_tensor_v4: bool = False
    mask_per_layer_type: bool = False
    masks_without_positions_v5: bool = False
    dense_model_type: str | None = None
