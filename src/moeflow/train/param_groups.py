"""What the Trainer's AdamW needs: parameter groups, the learning-rate schedule, correction biases.

It takes them from the model and the settings; the correction biases are the experts' ones, which the loss-free
balancing updates outside the optimizer."""

from __future__ import annotations

import math
from typing import Any

import torch

from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.model import parameters as P
from moeflow.parallel.layouts import original_shape


def set_learning_rate(optimizer: Any, lr: float, factor: float = 1.0) -> None:
    """The one place a learning rate is written: every group's is ``lr`` (train.lr) x its ``lr_multiplier`` x
    ``factor`` (the schedule's, :func:`lr_factor`). The Trainer calls it before every step."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_multiplier"] * factor


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (reaching the peak at the last warmup step), then cosine from
    the peak to ``min_ratio`` at ``total_steps``. The warmup part does not depend on ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress_ = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))


def param_groups(model: torch.nn.Module, settings: Any) -> list[dict[str, Any]]:
    """AdamW groups for ``settings`` (a ``moeflow.train.settings.TrainSettings``): no weight decay on norms and
    biases (``moeflow.model.parameters.takes_weight_decay``, on the shapes in the model, also when FSDP1 has
    flattened them), routers (also their peft base layer or adapter) at ``router_lr_multiplier``, or
    frozen with ``freeze_router``. Each group keeps its multiplier under ``lr_multiplier``; the Trainer sets every
    group's learning rate before each step (``train.lr x lr_multiplier x`` :func:`lr_factor`)."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        is_router = P.category(name) == P.ROUTER
        if is_router and settings.freeze_router:
            param.requires_grad_(False)
        if not param.requires_grad:
            continue
        groups.setdefault((is_router, P.takes_weight_decay(name, original_shape(param))), []).append(param)
    out = []
    for (is_router, decay), params in sorted(groups.items()):
        multiplier = settings.router_lr_multiplier if is_router else 1.0
        out.append(
            {
                "params": params,
                "weight_decay": settings.weight_decay if decay else 0.0,
                "lr_multiplier": multiplier,
                "name": ("router" if is_router else "other") + ("" if decay else "_no_decay"),
            }
        )
    return out


def correction_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    """DeepSeek-V3-style expert correction biases (``e_score_correction_bias``), in layer order; not those of
    MTP layers (moeflow.families.mtp), which route no token in the model's forward."""
    mtp = mtp_prefixes(model)
    found = [
        (name, t)
        for name, t in [*model.named_buffers(), *model.named_parameters()]
        if P.category(name) == P.CORRECTION_BIAS and not is_mtp_name(name, mtp)
    ]
    return [t for _, t in sorted(found, key=lambda nt: -1 if P.layer_index(nt[0]) is None else P.layer_index(nt[0]))]
