"""Routing drift: how fine-tuning moved the router, per MoE layer, over the same tokens.

A run's base and fine-tuned model are run over the same tokens: the coverage validation set, in
``moeflow.evaluation.loop`` batches.

Per MoE layer, over the non-padding tokens:

* ``js_divergence``: the Jensen-Shannon divergence (base 2, so in [0, 1]) of the two expert-load
  distributions, an expert's load being its share of the layer's top-k assignments;
* ``changed_expert_set_fraction``: the fraction of tokens whose set of chosen experts differs (the order
  within the top-k does not count);
* ``gained`` / ``lost``: the experts whose load share rose / fell by more than half the base's share
  (``LOAD_CHANGE``); an expert the base never chose gains as soon as it is chosen;
* ``entropy_base`` / ``entropy_finetuned`` / ``entropy_change``: the mean per-token entropy (nats) of the
  routing probabilities (``moeflow.model.routing.LayerRouting.probs``).

With several ranks holding the model in a layout, each routes its share of the batches (``moeflow.evaluation.loop``'s
``batches``) and the main rank puts the batches back in their order before anything is added up: the same chosen
experts, loads and divergences as one process, the entropies to the last digits the sharded forward changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeflow.data.collate import model_inputs, token_mask
from moeflow.evaluation.loop import FILLER, batches
from moeflow.model.chunked_loss import decoder_forward
from moeflow.model.routing import NoMoELayers, RoutingAdapter, adapter_or_none, capture
from moeflow.model.wrappers import unwrap
from moeflow.parallel.process_group import Ranks, gather_to_main
from moeflow.runtime.host_copies import model_device
from moeflow.runtime.stage import progress

LOAD_CHANGE = 0.5  # an expert gained or lost load: its share moved by more than half the base's share


@dataclass
class LayerTokens:
    """One model's routing of a set at one MoE layer, token by token (padding left out)."""

    layer: int
    num_experts: int
    expert_sets: np.ndarray  # (tokens, k) the chosen experts of each token, sorted
    entropy_sum: float  # summed per-token entropy of the routing probabilities (nats)

    @property
    def tokens(self) -> int:
        return int(self.expert_sets.shape[0])

    def load_share(self) -> np.ndarray:
        """(E,) each expert's share of the layer's top-k assignments."""
        counts = np.bincount(self.expert_sets.reshape(-1), minlength=self.num_experts).astype(np.float64)
        return counts / max(counts.sum(), 1.0)

    @property
    def mean_entropy(self) -> float:
        return self.entropy_sum / self.tokens if self.tokens else float("nan")


def token_entropy(probs: torch.Tensor) -> torch.Tensor:
    """(tokens,) entropy in nats of each row of (tokens, E) probabilities (0 log 0 = 0)."""
    return torch.special.entr(probs.double()).sum(dim=-1)


# One batch's routing: per MoE layer, (number of experts, (tokens, k) sorted chosen experts, summed entropy).
BatchRouting = dict[int, tuple[int, np.ndarray, float]]


def route_batches(
    model, collated: Iterable[Mapping[str, Any]], adapter: RoutingAdapter, precision: str = "fp32"
) -> list[BatchRouting]:
    """Every MoE layer's chosen experts and routing entropy for each real token, batch by batch, of the batches
    ``collated`` (``moeflow.data.collate.collate`` output; a :data:`FILLER` batch is run, not kept)."""
    device = model_device(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    out: list[BatchRouting] = []
    model.eval()
    with torch.no_grad(), autocast:
        for batch in collated:
            real = token_mask(batch).reshape(-1)
            with capture(model, adapter) as routing:
                decoder_forward(model, model_inputs(model, batch))  # the routers only: no output layer
            if FILLER in batch:
                continue
            layers: BatchRouting = {}
            for layer in routing.layers:
                chosen = layer.topk_index.reshape(real.shape[0], -1).cpu()[real]
                probs = layer.probs().reshape(real.shape[0], -1).cpu()[real]
                entropy = float(token_entropy(probs).sum())
                layers[layer.layer] = (layer.num_experts, torch.sort(chosen, dim=-1).values.numpy(), entropy)
            out.append(layers)
    return out


def layer_tokens(routed: Sequence[BatchRouting]) -> list[LayerTokens]:
    """Each MoE layer's :class:`LayerTokens` over batches in their order (entropies added in that order)."""
    sets: dict[int, list[np.ndarray]] = {}
    entropy: dict[int, float] = {}
    experts: dict[int, int] = {}
    for layers in routed:
        for layer, (num_experts, chosen, batch_entropy) in layers.items():
            sets.setdefault(layer, []).append(chosen)
            entropy[layer] = entropy.get(layer, 0.0) + batch_entropy
            experts[layer] = num_experts
    return [LayerTokens(layer, experts[layer], np.concatenate(sets[layer]), entropy[layer]) for layer in sorted(sets)]


def route_tokens(
    model, collated: Iterable[Mapping[str, Any]], adapter: RoutingAdapter, precision: str = "fp32"
) -> list[LayerTokens]:
    """Every MoE layer's chosen experts and routing entropy for each real token of the batches ``collated``
    (``moeflow.data.collate.collate`` output), in batch order."""
    return layer_tokens(route_batches(model, collated, adapter, precision))


def in_batch_order(parts: Sequence[Sequence[BatchRouting]]) -> list[BatchRouting]:
    """The ranks' batches (rank r's: batches r, r + ranks, ..., as ``moeflow.evaluation.loop.batches`` shares
    them out) back in the one-process order."""
    world, total = len(parts), sum(len(p) for p in parts)
    return [parts[k % world][k // world] for k in range(total)]


def js_divergence(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence of two distributions, base 2 (0: the same, 1: disjoint supports)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    m = (p + q) / 2

    def kl_to_m(x: np.ndarray) -> float:
        nonzero = x > 0
        return float(np.sum(x[nonzero] * np.log2(x[nonzero] / m[nonzero])))

    return max(0.0, (kl_to_m(p) + kl_to_m(q)) / 2)


def changed_set_fraction(base: np.ndarray, finetuned: np.ndarray) -> float:
    """The fraction of tokens whose (sorted) chosen-expert rows differ between two (tokens, k) arrays."""
    if base.shape != finetuned.shape:
        raise ValueError(f"routing of different tokens: {base.shape} vs {finetuned.shape}")
    return float(np.any(base != finetuned, axis=1).mean()) if len(base) else 0.0


def moved_experts(
    base_share: np.ndarray, finetuned_share: np.ndarray, load_change: float = LOAD_CHANGE
) -> tuple[list[int], list[int]]:
    """(gained, lost): experts whose share rose above / fell below (1 +- ``load_change``) x the base's."""
    gained = np.flatnonzero(finetuned_share > base_share * (1 + load_change))
    lost = np.flatnonzero(finetuned_share < base_share * (1 - load_change))
    return gained.tolist(), lost.tolist()


def layer_drift(base: LayerTokens, finetuned: LayerTokens) -> dict[str, Any]:
    """The drift record of one MoE layer (the keys of drift.json's ``layers``)."""
    if (base.layer, base.num_experts) != (finetuned.layer, finetuned.num_experts):
        raise ValueError(
            f"layer {base.layer} ({base.num_experts} experts) compared with "
            f"layer {finetuned.layer} ({finetuned.num_experts} experts)"
        )
    p, q = base.load_share(), finetuned.load_share()
    gained, lost = moved_experts(p, q)
    return {
        "layer": base.layer,
        "js_divergence": js_divergence(p, q),
        "changed_expert_set_fraction": changed_set_fraction(base.expert_sets, finetuned.expert_sets),
        "gained": gained,
        "lost": lost,
        "entropy_base": base.mean_entropy,
        "entropy_finetuned": finetuned.mean_entropy,
        "entropy_change": finetuned.mean_entropy - base.mean_entropy,
        "load_base": p.tolist(),
        "load_finetuned": q.tolist(),
    }


def drift_record(base: Sequence[LayerTokens], finetuned: Sequence[LayerTokens]) -> dict[str, Any]:
    """drift.json without provenance: ``layers`` (one record per MoE layer) and ``tokens`` compared."""
    if [b.layer for b in base] != [f.layer for f in finetuned]:
        raise ValueError(
            f"MoE layers differ: base {[b.layer for b in base]}, fine-tuned {[f.layer for f in finetuned]}"
        )
    return {
        "layers": [layer_drift(b, f) for b, f in zip(base, finetuned)],
        "tokens": base[0].tokens if base else 0,
    }


def model_routing(
    model, rows, settings: Mapping[str, Any], precision: str = "fp32", label: str = "", ranks: Ranks | None = None
) -> list[LayerTokens] | None:
    """``route_tokens`` of an MoE model over a set of packed rows in the evaluation's batches (``settings``:
    ``moeflow.workflow.keys.eval_batch_settings``); ``NoMoELayers`` for a model without experts. ``ranks``
    (several ranks holding ``model`` in a layout): each routes its share of the batches, and the main rank gets
    the whole set's routing, the other ranks None."""
    adapter = adapter_or_none(unwrap(model))
    if adapter is None:
        raise NoMoELayers(f"routing drift compares the routers of MoE models; the {label or 'given'} model has none")
    attn = unwrap(model).config._attn_implementation
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    collated = batches(rows, settings["batch_size"], attn, settings["max_sequences"], rank=rank, world=world)
    routed = route_batches(model, progress(collated, desc=f"routing drift: {label}"), adapter, precision)
    if world > 1:
        parts = gather_to_main(routed)
        if parts is None:
            return None
        routed = in_batch_order(parts)
    return layer_tokens(routed)
