"""Evaluation: loss and perplexity per evaluation set, before and after fine-tuning, and per expert.

For each evaluation set (the coverage validation set and each eval corpus's test split) the base model
and the fine-tuned model are run over the same packed batches (no grad, ``use_cache=False``, documents
masked from each other by ``moeflow.collate``). The loss of a set is the token-normalised cross-entropy:
the sum over every non-ignored next-token label divided by the number of such labels (never a mean of
batch means); perplexity is ``exp(loss)``.

For an MoE model the routing of the same forward (``moeflow.routing.capture``) gives, per layer and
expert, the tokens routed to it (its top-k assignments over the non-padding tokens) and the mean loss
of the tokens it served: a token's loss is the cross-entropy of predicting the next token from it, so
the experts that processed its hidden state are charged with that loss.

Everything here is a pure function of the model and the data; timings go to a separate record.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .collate import IGNORE_INDEX, MODEL_INPUTS


# --------------------------------------------------------------------------- one set, one model


@dataclass
class SetStats:
    """Sums over one evaluation set for one model. ``None`` expert arrays for a dense model."""

    loss_sum: float = 0.0
    label_tokens: int = 0
    sequences: int = 0
    input_tokens: int = 0  # non-padding tokens that went through the model
    routed: np.ndarray | None = None  # (L, E) top-k assignments
    served_loss_sum: np.ndarray | None = None  # (L, E) summed loss of the tokens each expert served
    served_label_tokens: np.ndarray | None = None  # (L, E) tokens with a label among them
    moe_layers: list[int] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole loop: reading and collating rows, forwards, statistics

    @property
    def loss(self) -> float:
        return self.loss_sum / self.label_tokens if self.label_tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def add_routing(self, layer_ids: list[int], routed, loss_sum, label_tokens) -> None:
        if self.routed is None:
            self.moe_layers = list(layer_ids)
            self.routed, self.served_loss_sum, self.served_label_tokens = routed, loss_sum, label_tokens
        else:
            self.routed += routed
            self.served_loss_sum += loss_sum
            self.served_label_tokens += label_tokens


def per_token_loss(logits, labels):
    """(B, S) cross-entropy of predicting token t+1 from position t, and the (B, S) mask of positions
    that have such a label; the last position of each row never does."""
    import torch.nn.functional as F

    from .losses import next_token_targets

    targets = next_token_targets(labels)
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    return loss, targets != IGNORE_INDEX


def routing_sums(layers, token_mask, token_loss, label_mask) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Per (layer, expert): assignments over ``token_mask``, summed loss and label count of the tokens served."""
    import torch

    flat_tokens = token_mask.reshape(-1)
    flat_labels = label_mask.reshape(-1)
    flat_loss = token_loss.reshape(-1).double()
    routed, loss_sum, label_tokens = [], [], []
    for layer in layers:
        index = layer.topk_index.reshape(flat_tokens.shape[0], -1).cpu()
        k, num_experts = index.shape[1], layer.num_experts
        routed.append(torch.bincount(index[flat_tokens].reshape(-1), minlength=num_experts))
        served = index[flat_labels].reshape(-1)
        loss_sum.append(torch.bincount(served, weights=flat_loss[flat_labels].repeat_interleave(k), minlength=num_experts))
        label_tokens.append(torch.bincount(served, minlength=num_experts))
    as_np = lambda rows, dtype: np.stack([r.numpy() for r in rows]).astype(dtype)  # noqa: E731
    return [layer.layer for layer in layers], as_np(routed, np.int64), as_np(loss_sum, np.float64), as_np(label_tokens, np.int64)


def evaluate_batches(model, batches: Iterable[Mapping[str, Any]], adapter=None, precision: str = "fp32") -> SetStats:
    """Run ``model`` over collated batches (``moeflow.collate.collate`` output) and sum loss and routing.

    ``adapter``: the model's ``moeflow.routing`` adapter, or None for a dense model (no expert statistics).
    Padding (negative ``doc_ids``, see ``moeflow.losses.token_mask``) is routed but not counted.
    """
    import torch

    from .losses import count_label_tokens, cross_entropy_sum, token_mask
    from .routing import capture

    stats = SetStats()
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    model.eval()
    started = time.perf_counter()
    with torch.no_grad(), autocast:
        for batch in batches:
            inputs = {k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS}
            labels = batch["labels"].to(device)
            if adapter is not None:
                with capture(model, adapter) as routing:
                    logits = model(**inputs, use_cache=False).logits
                layers = routing.layers
            else:
                logits = model(**inputs, use_cache=False).logits
                layers = []
            stats.loss_sum += float(cross_entropy_sum(logits, labels))
            stats.label_tokens += count_label_tokens(labels)
            stats.sequences += int(labels.shape[0])
            mask = token_mask(batch)
            stats.input_tokens += int(mask.sum())
            if layers:
                token_loss, label_mask = per_token_loss(logits, labels)
                stats.add_routing(*routing_sums(layers, mask.cpu(), token_loss.cpu(), label_mask.cpu()))
    stats.seconds = time.perf_counter() - started
    return stats


# --------------------------------------------------------------------------- records


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def balance(counts: Sequence[int]) -> dict[str, Any]:
    """Load balance of one layer (``moeflow.guards.layer_health``, the training guard's definition):
    max/mean, coefficient of variation, normalised load entropy (1 = uniform), dead experts."""
    from .guards import layer_health

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
                "mean_loss": [None if s is None or f is None else f - s for s, f in zip(b["mean_loss"], a["mean_loss"])],
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
        import torch

        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def speed_record(stats: Iterable[SetStats]) -> dict[str, float]:
    """Evaluation throughput over sets: non-padding tokens per second of forward passes."""
    stats = list(stats)
    tokens, seconds = sum(s.input_tokens for s in stats), sum(s.seconds for s in stats)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


# --------------------------------------------------------------------------- summary


def _fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def summary_markdown(metrics: Mapping[str, Any]) -> str:
    """A short human summary of ``metrics.json``: loss per set, forgetting, expert balance, coverage."""
    lines = [f"# Evaluation of run `{metrics['run']}`", ""]
    lines += ["| set | targeted | base loss | fine-tuned loss | change | base ppl | fine-tuned ppl |", "|---|---|---|---|---|---|---|"]
    for s in metrics["sets"]:
        lines.append(
            f"| {s['name']} | {'yes' if s['targeted'] else 'no'} | {_fmt(s['base']['loss'])} | {_fmt(s['finetuned']['loss'])} "
            f"| {_fmt(s['change'].get('loss'), 4)} | {_fmt(s['base']['perplexity'], 2)} | {_fmt(s['finetuned']['perplexity'], 2)} |"
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
                f"| {b['layer']} | {_fmt(bb['max_over_mean'], 2)} -> {_fmt(fb['max_over_mean'], 2)} | {_fmt(bb['cv'], 2)} -> {_fmt(fb['cv'], 2)} "
                f"| {_fmt(bb['load_entropy'], 3)} -> {_fmt(fb['load_entropy'], 3)} | {len(bb['dead_experts'])} -> {len(fb['dead_experts'])} |"
            )
    recheck = metrics.get("coverage_recheck")
    if recheck:
        newly = recheck["newly_below"]
        cells = ", ".join(f"layer {c['layer']} expert {c['expert']}" for c in newly) or "none"
        lines += ["", f"Coverage of the validation set with the fine-tuned router: {recheck['below_after']} (layer, expert) cells "
                  f"below the threshold (base router: {recheck['below_before']}); newly below: {cells}."]
    return "\n".join(lines) + "\n"


def batches(dataset, batch_size: int, attn_implementation: str, max_sequences: int | None = None) -> Iterator[dict]:
    """Collated batches (``moeflow.collate.collate``) of ``batch_size`` packed rows, in order, from a
    data-stage split (a ``datasets.Dataset`` or a list of rows), with ``doc_ids`` (-1 on padding)."""
    from .collate import collate

    n = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    for start in range(0, n, batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, n))]
        yield collate(rows, attn_implementation)


# --------------------------------------------------------------------------- a run


@dataclass
class EvalSet:
    """One evaluation set: a name for the tables, the corpora it was drawn from, and its rows."""

    name: str
    corpora: list[str]
    rows: Any  # a datasets.Dataset of packed rows (moeflow.tokenize format)


def evaluate_model(model, sets: Sequence[EvalSet], settings: Mapping[str, Any], precision: str = "fp32") -> dict[str, SetStats]:
    """Every set through one model (``settings``: the config's ``evaluate`` section)."""
    from .stage import progress
    from .train import routing_adapter

    adapter = routing_adapter(model)
    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    out = {}
    for s in sets:
        out[s.name] = evaluate_batches(
            model,
            progress(batches(s.rows, settings["batch_size"], attn, settings.get("max_sequences")), desc=f"evaluate {s.name}"),
            adapter,
            precision,
        )
    return out


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
            {**set_comparison(s.name, finetune_corpus in s.corpora, base[s.name], finetuned[s.name]), "corpora": list(s.corpora)}
            for s in sets
        ],
    }


# --------------------------------------------------------------------------- coverage, rechecked


def valset_coverage(model, rows, coverage_settings: Mapping[str, Any], precision: str = "fp32") -> dict[str, Any] | None:
    """Per (layer, expert) of ``model``'s router: validation documents with at least ``min_tokens`` tokens
    routed there (``moeflow.coverage.route_pool`` and ``cell_table``, as the coverage stage counts them).
    None for a model without experts."""
    from .coverage import cell_table, route_pool
    from .tokenize import iter_rows
    from .train import routing_adapter

    adapter = routing_adapter(model)
    if adapter is None:
        return None
    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    stats = route_pool(model, [("valset", iter_rows(rows))], int(coverage_settings["batch_tokens"]), attn, precision, adapter)
    docs, tokens = cell_table(stats, np.ones(stats.num_docs, dtype=bool), int(coverage_settings["min_tokens"]))
    return {"layers": list(stats.layers), "documents": stats.num_docs, "docs": docs.tolist(), "tokens": tokens.tolist()}


def coverage_recheck(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, coverage_settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """Which (layer, expert) cells of the validation set fall below the coverage threshold
    (``min_docs_per_expert`` documents with ``min_tokens`` tokens) with the base and the fine-tuned router."""
    if before is None or after is None:
        return None
    min_docs = int(coverage_settings["min_docs_per_expert"])

    def below(cov: Mapping[str, Any]) -> set[tuple[int, int]]:
        return {(layer, e) for layer, row in zip(cov["layers"], cov["docs"]) for e, n in enumerate(row) if n < min_docs}

    def cells(keys: set[tuple[int, int]], cov: Mapping[str, Any]) -> list[dict[str, int]]:
        position = {layer: i for i, layer in enumerate(cov["layers"])}
        return [{"layer": layer, "expert": e, "docs": int(cov["docs"][position[layer]][e])} for layer, e in sorted(keys)]

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
