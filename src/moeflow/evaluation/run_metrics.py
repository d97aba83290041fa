"""Evaluation: loss and perplexity per evaluation set, before and after fine-tuning, and per expert.

For each evaluation set (the coverage validation set and each eval corpus's test split) the base model
and the fine-tuned model are run over the same packed batches (no grad, ``use_cache=False``, documents
masked from each other by ``moeflow.data.collate``). The loss of a set is the token-normalised cross-entropy:
the sum over every non-ignored next-token label divided by the number of such labels (never a mean of
batch means); perplexity is ``exp(loss)``.

For an MoE model the routing of the same forward (``moeflow.model.routing.capture``) gives, per layer and
expert, the tokens routed to it (its top-k assignments over the non-padding tokens) and the mean loss
of the tokens it served: a token's loss is the cross-entropy of predicting the next token from it, so
the experts that processed its hidden state are charged with that loss. The loop itself is
``moeflow.evaluation.loop``; this module makes the stage's records and summaries from its sums.

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


def change_record(base: Mapping[str, Any], finetuned: Mapping[str, Any]) -> dict[str, Any]:
    """How a set's numbers moved from the base to the fine-tuned model (positive loss = worse)."""
    out: dict[str, Any] = {}
    if base["loss"] is not None and finetuned["loss"] is not None:
        out["loss"] = finetuned["loss"] - base["loss"]
        out["perplexity_ratio"] = finetuned["perplexity"] / base["perplexity"]
    if "experts" in base and "experts" in finetuned:
        out["experts"] = [
            {
                "layer": b["layer"],
                "share": [f - s for s, f in zip(b["share"], a["share"])],
                "mean_loss": [
                    None if s is None or f is None else f - s for s, f in zip(b["mean_loss"], a["mean_loss"])
                ],
            }
            for b, a in zip(base["experts"], finetuned["experts"])
        ]
    return out


def set_comparison(name: str, targeted: bool, base: SetStats, finetuned: SetStats) -> dict[str, Any]:
    """One evaluation set's record: both models, the change, and whether the fine-tune targeted it.

    A rise in loss on a set the fine-tune did not target is forgetting.
    """
    b, f = set_record(base), set_record(finetuned)
    change = change_record(b, f)
    return {
        "name": name,
        "targeted": targeted,
        "base": b,
        "finetuned": f,
        "change": change,
        "forgetting": (not targeted) and change.get("loss", 0.0) > 0,
    }


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


def _fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def summary_markdown(metrics: Mapping[str, Any]) -> str:
    """A short human summary of ``metrics.json``: loss per set, forgetting, expert balance, coverage."""
    lines = [f"# Evaluation of run `{metrics['run']}`", ""]
    lines += [
        "| set | targeted | base loss | fine-tuned loss | change | base ppl | fine-tuned ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in metrics["sets"]:
        lines.append(
            f"| {s['name']} | {'yes' if s['targeted'] else 'no'} | {_fmt(s['base']['loss'])} "
            f"| {_fmt(s['finetuned']['loss'])} "
            f"| {_fmt(s['change'].get('loss'), 4)} "
            f"| {_fmt(s['base']['perplexity'], 2)} | {_fmt(s['finetuned']['perplexity'], 2)} |"
        )
    forgotten = [s["name"] for s in metrics["sets"] if s["forgetting"]]
    lines += ["", f"Forgetting (loss rose on a set the fine-tune did not target): {', '.join(forgotten) or 'none'}."]
    experts_set = next((s for s in metrics["sets"] if "experts" in s["finetuned"]), None)
    if experts_set:
        lines += ["", f"Expert balance on `{experts_set['name']}` (base -> fine-tuned):", ""]
        lines += ["| layer | max/mean | CV | entropy (norm.) | dead |", "|---|---|---|---|---|"]
        for b, f in zip(experts_set["base"]["experts"], experts_set["finetuned"]["experts"]):
            bb, fb = b["balance"], f["balance"]
            lines.append(
                f"| {b['layer']} | {_fmt(bb['max_over_mean'], 2)} -> {_fmt(fb['max_over_mean'], 2)} "
                f"| {_fmt(bb['cv'], 2)} -> {_fmt(fb['cv'], 2)} "
                f"| {_fmt(bb['load_entropy'], 3)} -> {_fmt(fb['load_entropy'], 3)} "
                f"| {len(bb['dead_experts'])} -> {len(fb['dead_experts'])} |"
            )
    recheck = metrics.get("coverage_recheck")
    if recheck:
        newly = recheck["newly_below"]
        cells = ", ".join(f"layer {c['layer']} expert {c['expert']}" for c in newly) or "none"
        lines += [
            "",
            "Coverage of the validation set with the fine-tuned router: "
            f"{recheck['below_after']} (layer, expert) cells "
            f"below the threshold (base router: {recheck['below_before']}); newly below: {cells}.",
        ]
    return "\n".join(lines) + "\n"


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


def run_metrics(
    run: str,
    sets: Sequence[EvalSet],
    base: Mapping[str, SetStats],
    finetuned: Mapping[str, SetStats],
    finetune_corpus: str,
    parameters: Mapping[str, int],
) -> dict[str, Any]:
    """``metrics.json`` without provenance: every set's comparison, and the model's parameter counts."""
    return {
        "run": run,
        "finetune_corpus": finetune_corpus,
        "parameters": dict(parameters),
        "sets": [
            {
                **set_comparison(s.name, finetune_corpus in s.corpora, base[s.name], finetuned[s.name]),
                "corpora": list(s.corpora),
            }
            for s in sets
        ],
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


def coverage_recheck(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, coverage_settings: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Which (layer, expert) cells of the validation set fall below the coverage threshold
    (``min_docs_per_expert`` documents with ``min_tokens`` tokens) with the base and the fine-tuned router."""
    if before is None or after is None:
        return None
    min_docs = int(coverage_settings["min_docs_per_expert"])

    def below(cov: Mapping[str, Any]) -> set[tuple[int, int]]:
        return {(layer, e) for layer, row in zip(cov["layers"], cov["docs"]) for e, n in enumerate(row) if n < min_docs}

    def cells(keys: set[tuple[int, int]], cov: Mapping[str, Any]) -> list[dict[str, int]]:
        position = {layer: i for i, layer in enumerate(cov["layers"])}
        return [
            {"layer": layer, "expert": e, "docs": int(cov["docs"][position[layer]][e])} for layer, e in sorted(keys)
        ]

    b, a = below(before), below(after)
    return {
        "min_docs_per_expert": min_docs,
        "min_tokens": int(coverage_settings["min_tokens"]),
        "below_before": len(b),
        "below_after": len(a),
        "below_cells_after": cells(a, after),
        "newly_below": cells(a - b, after),
        "recovered": cells(b - a, after),
        "base": dict(before),
        "finetuned": dict(after),
    }
