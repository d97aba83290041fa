"""A run's base and fine-tuned model compared on every evaluation set, from their evaluation records.

The records are rule evaluate_model's (moeflow.evaluation.run_metrics.model_record): the loss's change per set,
forgetting, the per-expert changes, the validation set's coverage rechecked with the fine-tuned router, the summary.

A pure function of the two records: rule evaluate_run loads no model, so the base model's record, shared by the runs
that fine-tune it, is computed once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvaluateRunStage:
    """Rule evaluate_run: the run whose base and fine-tuned model's evaluations it compares, the corpus its
    fine-tune targeted, and the coverage thresholds the validation set's recheck counts against (``coverage``:
    min_docs_per_expert and min_tokens of the run whose validation set was read)."""

    run: str
    finetune_corpus: str
    coverage: dict[str, Any]


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


def set_comparison(name: str, targeted: bool, base: Mapping[str, Any], finetuned: Mapping[str, Any]) -> dict[str, Any]:
    """One evaluation set's record from both models' records (moeflow.evaluation.run_metrics.set_record): the
    change, and whether the fine-tune targeted it. A rise in loss on a set the fine-tune did not target is
    forgetting."""
    b, f = dict(base), dict(finetuned)
    change = change_record(b, f)
    return {
        "name": name,
        "targeted": targeted,
        "base": b,
        "finetuned": f,
        "change": change,
        "forgetting": (not targeted) and change.get("loss", 0.0) > 0,
    }


def compare_run(
    run: str, base: Mapping[str, Any], finetuned: Mapping[str, Any], finetune_corpus: str
) -> dict[str, Any]:
    """``metrics.json`` without provenance from the base and the fine-tuned model's records (rule evaluate_model's):
    every set's comparison, and the fine-tuned model's parameter counts."""
    before = {s["name"]: s["record"] for s in base["sets"]}
    if [s["name"] for s in base["sets"]] != [s["name"] for s in finetuned["sets"]]:
        raise ValueError(
            f"run {run!r}: the base and the fine-tuned model were evaluated on different sets "
            f"({sorted(before)} vs {[s['name'] for s in finetuned['sets']]})"
        )
    return {
        "run": run,
        "finetune_corpus": finetune_corpus,
        "parameters": dict(finetuned["parameters"]),
        "sets": [
            {
                **set_comparison(s["name"], finetune_corpus in s["corpora"], before[s["name"]], s["record"]),
                "corpora": list(s["corpora"]),
            }
            for s in finetuned["sets"]
        ],
    }


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
