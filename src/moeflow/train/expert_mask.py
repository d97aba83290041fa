"""ESFT's masked training: only the selected experts of moeflow.train.esft's selection train.

:func:`masked_training` (called by moeflow.train.trainer.Trainer before it builds the optimizer) freezes the
routers (and correction biases), and the shared experts and every non-expert parameter unless
``train.esft.train_shared_experts`` / ``train_non_expert``. Where each expert is its own module (transformers
4.57), an unselected expert's parameters get ``requires_grad`` False: no gradient, no optimizer state. Where a
layer's experts are one fused ``[E, ...]`` tensor (transformers 5), the tensor must train, and its unselected rows
are kept bit-identical by :class:`ExpertMask` (its docstring says why this is exact). The cost: AdamW's two
moments exist for the whole fused tensor, unselected rows included (all zeros); moeflow.plan.memory counts them.

Every layout of ``parallel.strategy``: ``requires_grad`` is set on the sharded parameters after sharding (FSDP2
copies it to the gathered parameter at each gather; FSDP1 with ``use_orig_params`` hands a frozen parameter no
gradient), and under FSDP2 or transformers' expert parallelism a fused tensor is a DTensor whose local rows are
masked by their rows in the whole tensor (moeflow.parallel.rank_load.global_rows), after the gradients are reduced.
A fused tensor under FSDP1 (a flat slice of elements, not of rows) is refused: no stack of ours has both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.model import parameters as P
from moeflow.model.wrappers import is_fsdp1
from moeflow.parallel import dtensors
from moeflow.parallel.layouts import original_shape
from moeflow.parallel.rank_load import global_rows


class EsftError(ValueError):
    """A model or selection that masked expert training cannot use, naming what to do."""


_EXPERT_INDEX = re.compile(r"(^|\.)experts\.(\d+)\.")  # transformers 4.57: one module per expert


@dataclass
class FusedRows:
    """A fused ``[E, ...]`` routed-expert tensor (or fused expert bias) of one layer and its selected rows."""

    name: str
    param: torch.nn.Parameter
    selected: torch.Tensor  # int64: the selected experts' rows in the whole tensor
    local_selected: torch.Tensor  # int64: which of this rank's rows (all rows of an unsharded tensor) are selected
    local_rows: int  # how many rows this rank holds

    @classmethod
    def of(cls, name: str, param: torch.nn.Parameter, selected: list[int]) -> FusedRows:
        """The rows of ``param`` (whole, or a DTensor sharded along dim 0: FSDP2, expert parallelism)."""
        rows = global_rows(param) if dtensors.is_dtensor(param) else list(range(param.shape[0]))
        chosen = set(selected)
        local = [i for i, row in enumerate(rows) if row in chosen]
        return cls(
            name, param, torch.tensor(selected, dtype=torch.long), torch.tensor(local, dtype=torch.long), len(rows)
        )


class ExpertMask:
    """Keeps the unselected rows of fused expert tensors bit-identical under AdamW.

    Each fused tensor sits in a parameter group of its own with ``weight_decay`` 0 (:meth:`param_groups`); the
    decay it would have had is kept as the group's ``row_weight_decay``. Before each optimizer step
    (:meth:`before_step`, after the gradients are reduced and before clipping) the unselected rows' gradients are
    set to exactly 0, and the selected rows are decayed as AdamW would (``p *= 1 - lr * weight_decay``, which
    AdamW applies before its moment update). Why the unselected rows then never change: AdamW creates its moments
    as zeros at the first step; a row whose gradient is 0 at every step keeps ``exp_avg = b1 * 0 + (1 - b1) * 0
    = 0`` and ``exp_avg_sq = 0``, so its update is ``-lr_t * 0 / (sqrt(0) + eps) = -0``, and ``p + -0 == p`` for
    every float (no weight decay reaches it: the group's is 0). Gradient clipping scales 0 to 0; a resumed run
    loads the same zero moments. Another optimizer keeps the rows only if its update of a zero-gradient,
    zero-state, zero-decay element is exactly 0 (Muon's Newton-Schulz step maps a zero slice to 0, not tested here).
    """

    def __init__(self, fused: list[FusedRows]):
        self.fused = fused
        self._ids = {id(f.param) for f in fused}

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``groups`` (moeflow.train.param_groups.param_groups) with each group's fused expert tensors moved into a
        group of their own without weight decay (class docstring)."""
        out = []
        for group in groups:
            rows = [p for p in group["params"] if id(p) in self._ids]
            rest = [p for p in group["params"] if id(p) not in self._ids]
            if rest:
                out.append({**group, "params": rest})
            if rows:
                out.append(
                    {
                        **group,
                        "params": rows,
                        "weight_decay": 0.0,
                        "row_weight_decay": group["weight_decay"],
                        "name": group["name"] + "_expert_rows",
                    }
                )
        return out

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the unselected rows' gradients and decay the selected rows (class docstring); the groups' learning
        rates must already be this step's."""
        decay = {id(p): (g["lr"], g.get("row_weight_decay", 0.0)) for g in optimizer.param_groups for p in g["params"]}
        with torch.no_grad():
            for fused in self.fused:
                param = dtensors.local_tensor(fused.param)
                rows = fused.local_selected.to(param.device)
                if fused.param.grad is not None:
                    grad = dtensors.local_tensor(fused.param.grad)
                    keep = torch.zeros(fused.local_rows, dtype=torch.bool, device=grad.device)
                    keep[rows] = True
                    grad.masked_fill_(~keep.view(-1, *[1] * (grad.dim() - 1)), 0)
                lr, weight_decay = decay[id(fused.param)]
                if weight_decay and lr and len(rows):
                    param.index_copy_(0, rows, param.index_select(0, rows).mul_(1 - lr * weight_decay))


def _layer_selection(selection: Mapping[str, Any]) -> dict[int, tuple[int, list[int]]]:
    """{decoder layer: (number of experts, selected experts)} of a selection (:func:`select_experts`)."""
    return {int(e["layer"]): (len(e["scores"]), [int(x) for x in e["selected"]]) for e in selection["layers"]}


def _trains(name: str, settings: Any, chosen: Mapping[int, tuple[int, list[int]]]) -> bool | None:
    """Whether a parameter trains under ESFT; None for a routed-expert parameter of a selected layer (decided by
    its expert index or its fused rows)."""
    category = P.category(name)
    if category in (P.ROUTED_EXPERTS, P.EXPERT_BIASES):
        return None if P.layer_index(name) in chosen else False  # e.g. an MTP layer's experts: not scored
    if category in (P.ROUTER, P.CORRECTION_BIAS):
        return False
    if category in (P.SHARED_EXPERTS, P.SHARED_EXPERT_GATE):
        return settings.train_shared_experts
    return settings.train_non_expert


def mask_experts(model: torch.nn.Module, settings: Any, selection: Mapping[str, Any]) -> ExpertMask:
    """Freeze everything ESFT does not train (module docstring) for ``selection`` (the selection JSON) and return
    the mask of the fused expert tensors. ``settings``: ``train.esft`` (moeflow.train.settings.EsftSettings).
    Never turns on a parameter the model keeps frozen (an MTP layer's). Before the optimizer is built."""
    chosen = _layer_selection(selection)
    fused, seen, separate_experts = [], set(), {}
    for name, param in model.named_parameters():
        trains = _trains(name, settings, chosen)
        if trains is not None:
            param.requires_grad_(param.requires_grad and trains)
            continue
        layer = P.layer_index(name)
        seen.add(layer)
        num_experts, selected = chosen[layer]
        separate = _EXPERT_INDEX.search(P.base_name(name))
        if separate:
            separate_experts.setdefault(layer, set()).add(int(separate.group(2)))
            param.requires_grad_(param.requires_grad and int(separate.group(2)) in selected)
            continue
        shape = original_shape(param)
        if not shape or shape[0] != num_experts:
            raise EsftError(
                f"ESFT: {name} (shape {tuple(shape)}) is a routed-expert parameter but not one row per expert of the "
                f"{num_experts} the selection scores in layer {layer}: the selection was made for another model "
                "(rerun the expert selection), or moeflow cannot mask this family's experts (use train.method: full "
                "or lora)"
            )
        if param.requires_grad and selected:
            if is_fsdp1(model):
                raise EsftError(
                    f"ESFT: {name} is a fused [experts, ...] tensor under FSDP1, whose flat shards split elements, not "
                    "experts, so its rows cannot be masked: use parallel.strategy: none, or a stack with FSDP2 "
                    "(STACK=current)"
                )
            fused.append(FusedRows.of(name, param, selected))
        else:
            param.requires_grad_(False)
    missing = sorted(set(chosen) - seen)
    if missing:
        raise EsftError(
            f"ESFT: the selection names MoE layers {missing}, whose experts this model does not have: the selection "
            "was made for another model (rerun the expert selection)"
        )
    for layer, experts in separate_experts.items():
        if experts != set(range(chosen[layer][0])):
            raise EsftError(
                f"ESFT: the selection scores {chosen[layer][0]} experts in layer {layer}, and the model has "
                f"{len(experts)}: the selection was made for another model (rerun the expert selection)"
            )
    return ExpertMask(fused)


def masked_training(model: torch.nn.Module, settings: Any, selection: Mapping[str, Any] | None) -> ExpertMask | None:
    """The Trainer's one call: for ``train.method: esft`` (``settings``: TrainSettings), :func:`mask_experts` with
    ``selection``; None for any other method."""
    if settings.method != "esft":
        return None
    if selection is None:
        raise EsftError(
            "train.method: esft needs the expert selection (the selection JSON of the select_experts rule), "
            "passed to the Trainer as expert_selection"
        )
    return mask_experts(model, settings.esft, selection)
