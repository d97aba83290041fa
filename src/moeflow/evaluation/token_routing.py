"""Each MoE layer's chosen experts and routing entropy, token by token, over a set's evaluation batches.

The routing behind routing drift (moeflow.evaluation.drift): rule evaluate_model routes the coverage validation set
through its model and keeps the result beside its record, so a base model shared by several runs is routed once.

With several ranks holding the model in a layout, each routes its share of the batches (``moeflow.evaluation.loop``'s
``batches``) and the main rank puts the batches back in their order before anything is added up: the same chosen
experts as one process, the entropies to the last digits the sharded forward changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from moeflow.data.collate import model_inputs, token_mask
from moeflow.evaluation.drift import LayerTokens
from moeflow.evaluation.loop import FILLER, batches
from moeflow.model.chunked_loss import decoder_forward
from moeflow.model.routing import NoMoELayers, RoutingAdapter, adapter_or_none, capture
from moeflow.model.wrappers import unwrap
from moeflow.parallel.process_group import Ranks, gather_to_main
from moeflow.runtime.host_copies import model_device
from moeflow.runtime.stage import progress


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
