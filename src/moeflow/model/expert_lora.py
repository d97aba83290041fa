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

A quantized base's experts module (moeflow.model.quantized_experts, every layout) gets these factors too, and reads
them itself, one expert at a time, rather than through the property.

Saved, merged and started as peft's own: :func:`peft_factors` gives the factors in peft's fused layout (``lora_A``
(r x experts, in) with each expert's rows together, ``lora_B`` (out, r x experts) with each rank's columns together)
under the names of peft's nested wrappers (the first registered tensor innermost), :func:`place_peft_factors` reads
them back from such a file, and :func:`initial_factors` draws them as peft does, in its module order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch

from moeflow.model.parameters import clean_name
from moeflow.model.settings import LoraSettings

SUFFIXES = ("_lora_A", "_lora_B")


_ADAPTED = "_moeflow_expert_lora"  # on an experts module: {tensor name: (scaling, transposed)}, registration order


_RUNNING = "_moeflow_adapted_weights"  # the adapted tensors while the module's forward runs


def factor_names(tensor: str) -> tuple[str, str]:
    return tensor + SUFFIXES[0], tensor + SUFFIXES[1]


def add_expert_adapters(
    model: torch.nn.Module, names: list[str], settings: LoraSettings, rank_times: dict[str, int] | None = None
) -> None:
    """Give each fused expert tensor of ``names`` (parameter names in ``model``) its factors and its module the
    property that adapts it (a quantized base's experts module reads them itself: moeflow.model.quantized_experts).
    ``rank_times``: name -> a multiple of the rank and alpha (moeflow.model.lora.apply_lora's). Call on the model
    before expert parallelism shards it (the meta-device model)."""
    by_module: dict[str, list[str]] = {}
    for name in names:
        path, _, tensor = name.rpartition(".")
        by_module.setdefault(path, []).append(tensor)
    for path, tensors in by_module.items():
        module = model.get_submodule(path)
        quantized = getattr(module, "parametrizations", {})  # read by moeflow.model.quantized_experts
        order = [*module._parameters, *quantized]
        transposed = bool(getattr(module, "is_transposed", False))  # (experts, in, out), as peft reads the flag
        adapted = {}
        for tensor in sorted(tensors, key=order.index):
            weight = quantized[tensor].original if tensor in quantized else module._parameters[tensor]
            experts, first, second = quantized[tensor][0].packing.shape if tensor in quantized else weight.shape
            out_features, in_features = (second, first) if transposed else (first, second)
            rank = settings.rank * (rank_times or {}).get(f"{path}.{tensor}", 1)
            a, b = factor_names(tensor)
            shapes = {a: (experts, rank, in_features), b: (experts, out_features, rank)}
            for factor, shape in shapes.items():
                module.register_parameter(
                    factor, torch.nn.Parameter(torch.empty(shape, dtype=torch.float32, device=weight.device))
                )
            adapted[tensor] = (settings.alpha / settings.rank, transposed)
        setattr(module, _ADAPTED, adapted)
        if not quantized:
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


def _adapted_class(cls: type, tensors: tuple[str, ...]) -> type:
    """``cls`` whose forward reads ``tensors`` adapted (each folded once per call: an eager experts loop reads
    them once per expert). Made for each module, never cached: a quantized module's class is parametrize's own for
    that instance, whose properties hold the module (a cache would keep every model's weights alive)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__[_RUNNING] = {tensor: adapted_weight(self, tensor) for tensor in tensors}
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__[_RUNNING] = None

    properties = {tensor: property(functools.partial(_read, tensor=tensor)) for tensor in tensors}
    return type(f"LoraAdapted{cls.__name__}", (cls,), {"forward": forward, **properties})


def ep_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The model's expert-parallel plan with each adapted tensor's factors split as the tensor is, and a quantized
    tensor's stored bytes (``<module>.parametrizations.<tensor>.original``, moeflow.model.quantization) in its
    place (None: neither)."""
    adapted = {tensor for _, module in adapted_modules(model) for tensor in adapted_tensors(module)}
    quantized = {tensor for module in model.modules() for tensor in getattr(module, "parametrizations", {})}
    plan = dict(model.ep_plan)
    out = {}
    for key, style in plan.items():
        module, _, tensor = key.rpartition(".")
        is_quantized = tensor in quantized and module.endswith("experts")
        out[f"{module}.parametrizations.{tensor}.original" if is_quantized else key] = style
        out |= {key + suffix: style for suffix in SUFFIXES} if tensor in adapted else {}
    return out if adapted or quantized else None


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


def factors_of_peft(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`peft_factors` undone: peft's fused (r x experts, in) and (out, r x experts) as (experts, r, in) and
    (experts, out, r)."""
    return a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)


def place_peft_factors(
    model: torch.nn.Module, weights: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Copy the factors' values out of an adapter file's ``weights`` (:func:`peft_factors`' layout, under
    :func:`peft_names`, as moeflow.model.lora saves them) into a LoRA model's factors. Returns the other tensors
    (peft's own adapters) and the adapted tensors the file has no factors for."""
    weights, lost = dict(weights), []
    with torch.no_grad():
        for path, module in adapted_modules(model):
            for tensor, wrapper in peft_names(clean_name(path), module).items():
                keys = f"{wrapper}.lora_A.weight", f"{wrapper}.lora_B.weight"
                if not all(key in weights for key in keys):
                    lost.append(f"{clean_name(path)}.{tensor}")
                    continue
                a, b = (module._parameters[name] for name in factor_names(tensor))
                for factor, value in zip((a, b), factors_of_peft(*map(weights.pop, keys), a.shape[0]), strict=True):
                    factor.copy_(value)
    return weights, lost


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
