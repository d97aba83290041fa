"""Routing telemetry: per MoE layer, each token's router logits, chosen experts and gate weights.

One structure (``LayerRouting``) for every consumer (coverage, balancing losses, monitoring,
evaluation), filled by forward hooks on the router modules of a supported HF MoE model::

    with capture(model) as routing:
        model(**inputs, use_cache=False)
    for layer in routing.layers:          # one per MoE layer (dense layers have no entry)
        layer.topk_index                  # (tokens, k) experts actually chosen; tokens = batch*seq

Each family's record (moeflow.families) names the class of its MoE block, the attribute that holds the
router, and how to read (logits, chosen experts, gate weights) from the router's forward.
The chosen experts are taken from what the model computed, never re-derived as a top-k of the logits,
because DeepSeek-V3/Step routers choose with a sigmoid score plus a correction bias, group-limited.

The two stacks differ: on transformers 5 every router returns ``(logits, weights, index)``; on 4.57 the
qwen2_moe/qwen3_moe/mixtral/olmoe gate is a plain ``nn.Linear`` (the top-k happens in the block, and is
repeated here with the block's own operations), DeepSeek-V3's router returns ``(index, weights)`` without
logits, GPT-OSS's returns dense scores, and GraniteMoE's returns expert-sorted gates.

Gradient checkpointing reruns each decoder layer in the backward pass, and with it the router hooks:
only the first call per layer after the model's forward starts is recorded (a forward pre-hook on the
captured model starts a new record). Use non-reentrant checkpointing (``use_reentrant=False``) when the
logits must carry gradient: the reentrant variant runs the first forward without grad.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from moeflow.families.family import EXPERT_COUNT_KEYS, SIGMOID, SOFTMAX, Family, Reader
from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.families.registry import FAMILIES
from moeflow.runtime import compat

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class UnsupportedModel(ValueError):
    """A model whose routing moeflow cannot read: no adapter for its family, or no MoE layer at all."""


class NoMoELayers(UnsupportedModel):
    """A model without MoE layers (a dense model): there is no routing to read."""


@dataclass
class LayerRouting:
    layer: int  # decoder layer index (dense layers have no entry)
    num_experts: int
    logits: torch.Tensor  # (tokens, E) router logits as computed in this forward (carry grad when grad is on)
    topk_index: torch.Tensor  # (tokens, k) int64: the experts actually chosen
    # (tokens, k): the weights the chosen experts' outputs are really multiplied by, routed scaling included
    # (Step-3.5: the router's weights, renormalised unless norm_expert_weight is false, x moe_router_scaling_factor,
    # which its MoE block applies after the experts; DeepSeek-V3's router returns its weights already x
    # routed_scaling_factor)
    topk_weight: torch.Tensor
    scoring: str = SOFTMAX  # how the router scores experts: softmax, or sigmoid (DeepSeek-V3, Step)

    def probs(self) -> torch.Tensor:
        """(tokens, E) routing probabilities for balancing losses, in float32 or the logits' dtype if wider
        (a float64 model keeps float64).

        Softmax routers: the softmax of the logits. Sigmoid routers: the sigmoid scores normalised to
        sum 1 per token.
        """
        logits = self.logits.to(torch.promote_types(self.logits.dtype, torch.float32))
        if self.scoring == SIGMOID:
            scores = torch.sigmoid(logits)
            return scores / scores.sum(dim=-1, keepdim=True)
        return torch.softmax(logits, dim=-1)


ADAPTER_NEEDS = (
    "an adapter (its family's record, moeflow.families.registry.FAMILIES) needs the class name of the family's "
    "MoE block, the block attribute holding its router module, whether the router scores with softmax or sigmoid, "
    "and a reader that returns (logits, chosen expert index, gate weights) from the router's forward inputs and output"
)


@dataclass(frozen=True)
class RouterSite:
    """One MoE layer's router: where to hook and how to read it."""

    layer: int
    name: str  # qualified module name of the router
    block: torch.nn.Module
    router: torch.nn.Module
    num_experts: int
    top_k: int

    @property
    def weight(self) -> torch.nn.Parameter:
        """The router's (E, hidden) weight (4.57's GraniteMoE keeps it in a child Linear)."""
        weight = getattr(self.router, "weight", None)
        return weight if weight is not None else self.router.layer.weight


def _unwrapped(router: torch.nn.Module) -> torch.nn.Module:
    """peft wraps a router that gets its own LoRA adapter; the attributes live on the base layer."""
    return router.get_base_layer() if hasattr(router, "get_base_layer") else router


def _num_experts(block: torch.nn.Module, router: torch.nn.Module) -> int:
    for owner in (_unwrapped(router), block):
        for attr in ("num_experts", "n_routed_experts", "out_features"):
            value = getattr(owner, attr, None)
            if isinstance(value, int):
                return value
    return int(router.weight.shape[0])


def _top_k(block: torch.nn.Module, router: torch.nn.Module) -> int:
    for owner in (_unwrapped(router), block):
        value = getattr(owner, "top_k", None)
        if isinstance(value, int):
            return value
    raise UnsupportedModel(f"router {type(router).__name__} has no top_k attribute; {ADAPTER_NEEDS}")


@dataclass
class RoutingAdapter:
    """The routers of one model, in decoder-layer order, with the family's reader."""

    model_type: str
    family: Family
    sites: list[RouterSite]
    read: Reader

    @property
    def scoring(self) -> str:
        return self.family.scoring

    @property
    def moe_layers(self) -> list[int]:
        return [site.layer for site in self.sites]

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (the same in every supported family)."""
        return self.sites[0].num_experts

    @property
    def top_k(self) -> int:
        return self.sites[0].top_k

    def to_layer_routing(self, site: RouterSite, args: tuple, output: Any) -> LayerRouting:
        logits, index, weights = self.read(site.block, site.router, args, output)
        return LayerRouting(
            layer=site.layer,
            num_experts=site.num_experts,
            logits=logits,
            topk_index=index.long(),
            topk_weight=weights,
            scoring=self.family.scoring,
        )


def _model_type(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def _expert_count(model: torch.nn.Module) -> str | None:
    """``key=value`` of the config attribute that names an expert count above 1, or None (a dense config)."""
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    for cfg in configs:
        for key in EXPERT_COUNT_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 1:
                return f"{key}={value}"
    return None


_LAYER_CHILD = re.compile(r"(?:^|\.)layers\.\d+\.[^.]+$")


def _layer_module_classes(model: torch.nn.Module) -> list[str]:
    """The class names of the decoder layers' direct children (attention, norms, the MLP or MoE block), sorted."""
    return sorted({type(m).__name__ for name, m in model.named_modules() if _LAYER_CHILD.search(name)})


def adapter_for(model: torch.nn.Module) -> RoutingAdapter:
    """The routing adapter for a supported HF MoE model; ``NoMoELayers`` for a dense model,
    ``UnsupportedModel`` for an MoE model moeflow cannot read."""
    model_type = _model_type(model)
    family = FAMILIES.get(model_type)
    if family is None:
        experts = _expert_count(model)
        hint = (
            f"its config has {experts}, so it looks like a mixture-of-experts model"
            if experts
            else "its config names no experts, so it looks like a dense model"
        )
        error = UnsupportedModel if experts else NoMoELayers
        raise error(
            f"no routing adapter for model_type {model_type!r} ({hint}). "
            f"Supported: {', '.join(sorted(FAMILIES))}. To add one: {ADAPTER_NEEDS}."
        )
    if compat.is_transformers_v5():
        read = family.read_v5
    elif family.read_v4 is None:
        raise compat.UnsupportedOnStack(
            f"routing for model_type {model_type!r} needs transformers 5 (the 'current' stack); "
            f"this environment has transformers {compat.version_of('transformers')}"
        )
    else:
        read = family.read_v4

    sites: list[RouterSite] = []
    mtp = mtp_prefixes(model)  # MTP layers do not run in the model's forward: no routing to read
    for name, module in model.named_modules():
        if type(module).__name__ != family.block_class or is_mtp_name(name, mtp):
            continue
        router = getattr(module, family.router_attr, None)
        if router is None:
            raise UnsupportedModel(
                f"{model_type}: MoE block {name} ({family.block_class}) has no attribute "
                f"{family.router_attr!r}; this transformers version lays the family out differently: {ADAPTER_NEEDS}"
            )
        indices = _LAYER_INDEX.findall(name)
        layer = int(indices[-1]) if indices else len(sites)
        sites.append(
            RouterSite(
                layer=layer,
                name=f"{name}.{family.router_attr}",
                block=module,
                router=router,
                num_experts=_num_experts(module, router),
                top_k=_top_k(module, router),
            )
        )
    if not sites:
        found = ", ".join(_layer_module_classes(model)) or "none"
        experts = _expert_count(model)
        if experts:  # an MoE by its config whose blocks are named otherwise (remote code, a renamed class)
            raise UnsupportedModel(
                f"model_type {model_type!r}: its config has {experts}, but no {family.block_class} module was found "
                f"in it (the decoder layers hold: {found}), so moeflow cannot read its routing and would train it "
                f"as dense (no balancing, no routing guard, no bias update). Use the model's transformers class "
                f"(not remote code), or add the block: {ADAPTER_NEEDS}. For a dense model, set num_experts to 0"
            )
        raise NoMoELayers(
            f"model_type {model_type!r}: no {family.block_class} module found (the decoder layers hold: {found}), "
            f"so the model has no MoE layer (a dense configuration); routing telemetry needs at least one MoE layer"
        )
    sites.sort(key=lambda s: s.layer)
    return RoutingAdapter(model_type=model_type, family=family, sites=sites, read=read)


def adapter_or_none(model: torch.nn.Module) -> RoutingAdapter | None:
    """The routing adapter of an MoE model; None for a model without MoE layers."""
    try:
        return adapter_for(model)
    except NoMoELayers:
        return None


@dataclass
class RoutingCapture:
    """Filled by ``capture``: the routing of the model's last forward."""

    adapter: RoutingAdapter
    _records: dict[int, LayerRouting] = field(default_factory=dict)

    @property
    def layers(self) -> list[LayerRouting]:
        """One LayerRouting per MoE layer, in layer order, for the last forward."""
        return [self._records[layer] for layer in sorted(self._records)]

    def clear(self) -> None:
        self._records.clear()


@contextlib.contextmanager
def capture(model: torch.nn.Module, adapter: RoutingAdapter | None = None) -> Iterator[RoutingCapture]:
    """Record every MoE layer's routing while the context is open (hooks are removed on exit).

    Call the model itself (not a submodule) inside the context: its forward pre-hook starts a new
    record, and a router call for a layer already recorded (the recomputation under gradient
    checkpointing) is ignored.
    """
    adapter = adapter or adapter_for(model)
    routing = RoutingCapture(adapter)
    handles = [model.register_forward_pre_hook(lambda module, args: routing.clear())]

    def hook_for(site: RouterSite):
        def hook(module, args, output):
            # Read on the recomputation too, then drop it: non-reentrant checkpointing requires the
            # rerun to save the same tensors as the forward, and some readers compute with grad.
            record = adapter.to_layer_routing(site, args, output)
            routing._records.setdefault(site.layer, record)

        return hook

    try:
        for site in adapter.sites:
            handles.append(site.router.register_forward_hook(hook_for(site)))
        yield routing
    finally:
        for handle in handles:
            handle.remove()
