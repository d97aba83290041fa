"""LoRA adapters on fused expert tensors that expert parallelism splits by experts, together with the tensors.

Under ``parallel.strategy: ep`` transformers 5 shards each fused expert tensor (``mlp.experts.gate_up_proj``,
``down_proj``) over the ranks by experts, by the names of its expert-parallel plan, and runs a rank's experts on its
local rows. peft's ``target_parameters`` adapters would wrap the experts module and move it out of those names, so
under ``ep`` each adapted tensor ``<name>`` gets two sibling parameters on its own module instead: ``<name>_lora_A``
(experts, r, in) and ``<name>_lora_B`` (experts, out, r), fp32 as peft keeps its adapters. :func:`ep_plan` puts them
in the plan beside the tensor, so transformers splits them by experts with it, hands the experts' forward their
local rows and reduces their gradients as the tensor's (its ``efsdp`` unit). The module's class gains a property per
adapted tensor: while the module runs, the tensor plus ``alpha / r x B_e @ A_e`` for each expert, folded in the
tensor's dtype as peft's ``ParamWrapper`` folds it (``baddbmm``, autocast off); outside its forward, the tensor
itself (peft's wrapper leaves a direct read unadapted too).

Saved, merged and started as peft's own: :func:`peft_factors` gives the factors in peft's fused layout (``lora_A``
(r x experts, in) with each expert's rows together, ``lora_B`` (out, r x experts) with each rank's columns together)
under the names of peft's nested wrappers (the first registered tensor innermost), and :func:`initial_factors` draws
them as peft does, in its module order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch

from moeflow.model.settings import LoraSettings

SUFFIXES = ("_lora_A", "_lora_B")


_ADAPTED = "_moeflow_expert_lora"  # on an experts module: {tensor name: (scaling, transposed)}, registration order


_RUNNING = "_moeflow_adapted_weights"  # the adapted tensors while the module's forward runs


def factor_names(tensor: str) -> tuple[str, str]:
    return tensor + SUFFIXES[0], tensor + SUFFIXES[1]


def add_expert_adapters(model: torch.nn.Module, names: list[str], settings: LoraSettings) -> None:
    """Give each fused expert tensor of ``names`` (parameter names in ``model``) its factors and its module the
    property that adapts it. Call on the model before expert parallelism shards it (the meta-device model)."""
    by_module: dict[str, list[str]] = {}
    for name in names:
        path, _, tensor = name.rpartition(".")
        by_module.setdefault(path, []).append(tensor)
    for path, tensors in by_module.items():
        module = model.get_submodule(path)
        order = list(module._parameters)
        transposed = bool(getattr(module, "is_transposed", False))  # (experts, in, out), as peft reads the flag
        adapted = {}
        for tensor in sorted(tensors, key=order.index):
            weight = module._parameters[tensor]
            experts, first, second = weight.shape
            out_features, in_features = (second, first) if transposed else (first, second)
            a, b = factor_names(tensor)
            shapes = {a: (experts, settings.rank, in_features), b: (experts, out_features, settings.rank)}
            for factor, shape in shapes.items():
                module.register_parameter(
                    factor, torch.nn.Parameter(torch.empty(shape, dtype=torch.float32, device=weight.device))
                )
            adapted[tensor] = (settings.alpha / settings.rank, transposed)
        setattr(module, _ADAPTED, adapted)
        module.__class__ = _adapted_class(type(module), tuple(adapted))


def adapted_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of each module with expert adapters, in module order."""
    for path, module in model.named_modules():
        if adapted_tensors(module):
            yield path, module


def adapted_tensors(module: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """An experts module's adapted tensors: name -> (scaling, transposed), in registration order (none for another
    module)."""
    return getattr(module, _ADAPTED, None) or {}


def adapted_weight(module: torch.nn.Module, tensor: str) -> torch.Tensor:
    """The tensor with its adapter's update folded in, as peft's ``_LoraFactorsProxy`` folds it."""
    weight = module._parameters[tensor]
    a, b = (module._parameters[name] for name in factor_names(tensor))
    scaling, transposed = adapted_tensors(module)[tensor]
    lhs, rhs = (a.transpose(-2, -1), b.transpose(-2, -1)) if transposed else (b, a)
    with torch.autocast(device_type=weight.device.type, enabled=False):
        return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scaling)


def _read(module: torch.nn.Module, tensor: str) -> torch.Tensor:
    running = module.__dict__.get(_RUNNING)
    return running[tensor] if running else module._parameters[tensor]


@functools.cache
def _adapted_class(cls: type, tensors: tuple[str, ...]) -> type:
    """``cls`` whose forward reads ``tensors`` adapted (each folded once per call: an eager experts loop reads
    them once per expert)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__[_RUNNING] = {tensor: adapted_weight(self, tensor) for tensor in tensors}
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__[_RUNNING] = None

    properties = {tensor: property(functools.partial(_read, tensor=tensor)) for tensor in tensors}
    return type(f"LoraAdapted{cls.__name__}", (cls,), {"forward": forward, **properties})


def ep_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The model's expert-parallel plan with each adapted tensor's factors split as the tensor is (None: no expert
    adapters)."""
    adapted = {tensor for _, module in adapted_modules(model) for tensor in adapted_tensors(module)}
    if not adapted:
        return None
    plan = dict(model.ep_plan)
    factors = {
        key + suffix: style for key, style in plan.items() if key.rpartition(".")[2] in adapted for suffix in SUFFIXES
    }
    return plan | factors


def peft_names(path: str, module: torch.nn.Module) -> dict[str, str]:
    """Tensor -> the module path peft's nested ``ParamWrapper`` for it has: peft wraps an experts module's
    targeted tensors in their registration order, so the first is innermost (``.base_layer`` for each later one)."""
    tensors = list(adapted_tensors(module))
    return {tensor: path + ".base_layer" * (len(tensors) - 1 - i) for i, tensor in enumerate(tensors)}


def peft_factors(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole factors (experts, r, in) and (experts, out, r) in peft's fused layout: (r x experts, in) and
    (out, r x experts)."""
    experts, rank, in_features = a.shape
    return a.reshape(experts * rank, in_features), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)


def lora_a_start(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A ``lora_A`` weight's start as peft draws it, in fp32: Kaiming-uniform with ``a=sqrt(5)`` over ``shape``."""
    start = torch.empty(shape, dtype=torch.float32)
    return torch.nn.init.kaiming_uniform_(start, a=math.sqrt(5), generator=generator)


def initial_factors(path: str, module: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The factors' start by name, drawn as peft draws its wrappers' (``lora_A`` Kaiming-uniform over the whole
    (r x experts, in) tensor, ``lora_B`` zero), outermost wrapper first (its module order)."""
    out = {}
    for tensor in reversed(adapted_tensors(module)):
        a_name, b_name = factor_names(tensor)
        a, b = module._parameters[a_name], module._parameters[b_name]
        experts, rank, in_features = a.shape
        out[f"{path}.{a_name}"] = lora_a_start((experts * rank, in_features), generator).reshape(a.shape)
        out[f"{path}.{b_name}"] = torch.zeros(tuple(b.shape), dtype=torch.float32)
    return out
