"""Evaluation of one model: loss and perplexity per evaluation set, and per expert.

For each evaluation set (the coverage validation set and each eval corpus's test split) the model (a run's base
or its fine-tuned one: moeflow.evaluation.comparison compares the two records) is run over the packed batches (no
grad, ``use_cache=False``, documents masked from each other by ``moeflow.data.collate``). The loss of a set is
the token-normalised cross-entropy: the sum over every non-ignored next-token label divided by the number of such
labels (never a mean of batch means); perplexity is ``exp(loss)``.

For an MoE model the routing of the same forward (``moeflow.model.routing.capture``) gives, per layer and
expert, the tokens routed to it (its top-k assignments over the non-padding tokens) and the mean loss
of the tokens it served: a token's loss is the cross-entropy of predicting the next token from it, so
the experts that processed its hidden state are charged with that loss. The loop itself is
``moeflow.evaluation.loop``; this module makes the stage's record from its sums.

Everything here is a pure function of the model and the data; timings go to a separate record.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeflow.data.shards import iter_rows
from moeflow.evaluation.loop import SetStats, batches, evaluate_batches, sum_stats
from moeflow.evaluation.routing_stats import cell_table, layer_health, route_pool
from moeflow.model.parameters import active_per_token, clean_name
from moeflow.model.routing import adapter_or_none
from moeflow.model.wrappers import unwrap
from moeflow.parallel.layouts import original_shape, reshard
from moeflow.parallel.process_group import Ranks, gather_objects
from moeflow.runtime.stage import progress


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def balance(counts: Sequence[int]) -> dict[str, Any]:
    """Load balance of one layer (``moeflow.evaluation.routing_stats.layer_health``, the training guard's definition):
    max/mean, coefficient of variation, normalised load entropy (1 = uniform), dead experts."""
    health = layer_health([int(c) for c in counts])
    return {k: health[k] for k in ("max_over_mean", "cv", "load_entropy", "dead_experts")}


def set_record(stats: SetStats) -> dict[str, Any]:
    """The JSON record of one model on one set: loss, perplexity, counts, and per-expert tables."""
    out: dict[str, Any] = {
        "loss": _finite(stats.loss),
        "perplexity": _finite(stats.perplexity) if stats.label_tokens else None,
        "label_tokens": stats.label_tokens,
        "input_tokens": stats.input_tokens,
        "sequences": stats.sequences,
    }
    if stats.routed is not None:
        layers = []
        for row, layer in enumerate(stats.moe_layers):
            routed = stats.routed[row]
            served = stats.served_label_tokens[row]
            with np.errstate(invalid="ignore", divide="ignore"):
                mean_loss = stats.served_loss_sum[row] / served
            layers.append(
                {
                    "layer": int(layer),
                    "tokens": routed.tolist(),
                    "share": (routed / max(int(routed.sum()), 1)).tolist(),
                    "mean_loss": [_finite(x) for x in mean_loss],
                    "balance": balance(routed),
                }
            )
        out["experts"] = layers
    return out


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this process so far: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def speed_record(stats: Iterable[SetStats]) -> dict[str, float]:
    """Evaluation throughput over sets: non-padding tokens per second of forward passes."""
    stats = list(stats)
    tokens, seconds = sum(s.input_tokens for s in stats), sum(s.seconds for s in stats)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


@dataclass
class EvalSet:
    """One evaluation set: a name for the tables, the corpora it was drawn from, and its rows."""

    name: str
    corpora: list[str]
    rows: Any  # a datasets.Dataset of packed rows (moeflow.data.shards format)


def evaluate_model(
    model, sets: Sequence[EvalSet], settings: Mapping[str, Any], precision: str = "fp32", ranks: Ranks | None = None
) -> dict[str, SetStats]:
    """Every set through one model (``settings``: the config's ``evaluate`` section). With ``ranks`` (several
    ranks holding the model in a layout), each rank runs its share of the batches (moeflow.evaluation.loop's
    ``batches``) and every rank gets the whole set's sums, added in rank order."""
    adapter = adapter_or_none(unwrap(model))
    attn = unwrap(model).config._attn_implementation
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    out = {}
    for s in sets:
        shard = batches(s.rows, settings["batch_size"], attn, settings["max_sequences"], rank=rank, world=world)
        part = evaluate_batches(model, progress(shard, desc=f"evaluate {s.name}"), adapter, precision)
        out[s.name] = sum_stats(gather_objects(part)) if world > 1 else part
    reshard(model)  # FSDP2 keeps the root unit gathered after a forward without backward
    return out


def parameter_counts(model) -> dict[str, int]:
    """The model's parameters, total and active per token, by their whole sizes in any layout."""
    sizes = {clean_name(name): math.prod(original_shape(p)) for name, p in model.named_parameters()}
    return {"total": sum(sizes.values()), "active_per_token": active_per_token(unwrap(model).config, sizes)}


def model_record(
    sets: Sequence[EvalSet],
    stats: Mapping[str, SetStats],
    coverage: Mapping[str, Any] | None,
    parameters: Mapping[str, int],
) -> dict[str, Any]:
    """One model's evaluation (rule evaluate_model's JSON, without provenance and speed): each set's record
    (:func:`set_record`) with the corpora it was drawn from, the validation set's coverage by its router, and its
    parameter counts. Shared by every run that fine-tunes this model and evaluates it alike."""
    return {
        "sets": [{"name": s.name, "corpora": list(s.corpora), "record": set_record(stats[s.name])} for s in sets],
        "coverage": coverage,
        "parameters": dict(parameters),
    }


def valset_coverage(
    model, rows, coverage_settings: Mapping[str, Any], precision: str = "fp32", ranks: Ranks | None = None
) -> dict[str, Any] | None:
    """Per (layer, expert) of ``model``'s router: validation documents with at least ``min_tokens`` tokens
    routed there (``moeflow.evaluation.routing_stats.route_pool`` and ``cell_table``, as the coverage stage counts
    them).
    With several ``ranks`` each routes its share of the batches and only the main rank gets the table.
    None for a model without experts, and on the other ranks."""
    adapter = adapter_or_none(unwrap(model))
    if adapter is None:
        return None
    attn = unwrap(model).config._attn_implementation
    stats = route_pool(
        model,
        [("valset", iter_rows(rows))],
        int(coverage_settings["batch_tokens"]),
        attn,
        precision,
        adapter,
        ranks=ranks,
    )
    if stats is None:
        return None
    docs, tokens = cell_table(stats, np.ones(stats.num_docs, dtype=bool), int(coverage_settings["min_tokens"]))
    return {"layers": list(stats.layers), "documents": stats.num_docs, "docs": docs.tolist(), "tokens": tokens.tolist()}
