"""The evaluation stages' results as the paper reads them, and the rows of its tables.

Per run: the lm-eval task scores, HumanEval pass@k and routing drift (the JSON files of the lm_eval, humaneval and
routing_drift rules); the tables are the paper's task, pass@k, drift and forgetting tables.

Forgetting is the change from the base to the fine-tuned model on the general slice (``data.base_corpus``'s
test split) beside the target slice (``data.finetune_corpus``'s), for the loss (evaluate's metrics.json),
each lm-eval task's metrics and pass@k. A measure a run was not evaluated on (no ``evaluate.tasks``,
HumanEval off) has no column at all: absent, never a zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moeflow.runtime.files import read_json

MODELS = ("base", "finetuned")  # the two models every evaluation stage scores, as its result folders name them


@dataclass
class RunResults:
    """One run's results beyond metrics.json: what the forgetting table compares."""

    general_corpus: str = ""  # data.base_corpus
    target_corpus: str = ""  # data.finetune_corpus
    lm_eval: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)  # task -> model -> result
    humaneval: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # model -> results.json ({}: off)
    drift: Mapping[str, Any] | None = None  # drift.json (MoE runs)


def read_run_results(
    general_corpus: str,
    target_corpus: str,
    lm_eval: Mapping[str, Mapping[str, str]],
    humaneval: Mapping[str, str],
    drift: str | None,
) -> RunResults:
    """A run's results from the paths the paper rule lists (common.smk's ``eval_result_files``):
    ``lm_eval`` task -> model -> path, ``humaneval`` model -> path, ``drift`` a path or None."""
    return RunResults(
        general_corpus=general_corpus,
        target_corpus=target_corpus,
        lm_eval={task: {model: read_json(path) for model, path in paths.items()} for task, paths in lm_eval.items()},
        humaneval={model: read_json(path) for model, path in humaneval.items()},
        drift=read_json(drift) if drift else None,
    )


def stage_documents(run: str, results: RunResults) -> dict[str, Mapping[str, Any]]:
    """The result documents of a run by label (their ``provenance`` records go into the paper's)."""
    docs: dict[str, Mapping[str, Any]] = {
        f"lm_eval/{run}/{model}/{task}": doc
        for task, by_model in results.lm_eval.items()
        for model, doc in by_model.items()
    }
    docs |= {f"humaneval/{run}/{model}": doc for model, doc in results.humaneval.items()}
    if results.drift is not None:
        docs[f"routing_drift/{run}"] = results.drift
    return docs


def eval_set(metrics: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    """A run's evaluation record of the set ``name`` (metrics.json's ``sets``), None where it has none."""
    return next((s for s in metrics["sets"] if s["name"] == name), None)


def change(base: float | None, finetuned: float | None) -> float | None:
    return finetuned - base if base is not None and finetuned is not None else None


def lm_eval_rows(run: str, results: RunResults) -> list[dict[str, Any]]:
    """Per (task, metric): both models' value with lm-eval's standard error, and the change."""
    rows = []
    for task, by_model in results.lm_eval.items():
        base, tuned = by_model["base"], by_model["finetuned"]
        for metric in sorted(base["metrics"]):
            b, f = base["metrics"][metric], tuned["metrics"][metric]
            rows.append(
                {
                    "run": run,
                    "task": task,
                    "metric": metric,
                    "base": b["value"],
                    "base stderr": b["stderr"],
                    "fine-tuned": f["value"],
                    "fine-tuned stderr": f["stderr"],
                    "change": change(b["value"], f["value"]),
                    "samples": tuned["num_samples"],
                }
            )
    return rows


def pass_at_k(result: Mapping[str, Any]) -> dict[str, float]:
    """HumanEval's measures by name: ``greedy pass@1``, then ``sampled pass@K`` by increasing K."""
    sampled = result["pass_at_k"]["sampled"]
    out = {f"greedy {name}": value for name, value in result["pass_at_k"]["greedy"].items()}
    out |= {f"sampled {name}": sampled[name] for name in sorted(sampled, key=lambda n: int(n.removeprefix("pass@")))}
    return out


def humaneval_rows(run: str, results: RunResults) -> list[dict[str, Any]]:
    """Per pass@k measure: both models' value and the change (none when HumanEval is off)."""
    if not results.humaneval:
        return []
    base, tuned = pass_at_k(results.humaneval["base"]), pass_at_k(results.humaneval["finetuned"])
    problems = len(results.humaneval["finetuned"]["problems"])
    return [
        {
            "run": run,
            "measure": m,
            "base": base[m],
            "fine-tuned": tuned[m],
            "change": change(base[m], tuned[m]),
            "problems": problems,
        }
        for m in base
    ]


def loss_change(metrics: Mapping[str, Any], corpus: str) -> float | None:
    """The loss change on ``corpus``'s test split (None if the run was not evaluated on it)."""
    s = eval_set(metrics, f"test/{corpus}")
    return s["change"]["loss"] if s is not None and "loss" in s["change"] else None


def forgetting_changes(metrics: Mapping[str, Any], results: RunResults) -> dict[str, float | None]:
    """Base-to-fine-tuned changes of one run by column: the loss on the general and the target slice, each
    lm-eval task's metrics, each pass@k (a loss rise is worse, a score rise better)."""
    out = {
        "general loss change": loss_change(metrics, results.general_corpus),
        "target loss change": loss_change(metrics, results.target_corpus),
    }
    out |= {f"{r['task']} {r['metric']} change": r["change"] for r in lm_eval_rows("", results)}
    out |= {f"HumanEval {r['measure']} change": r["change"] for r in humaneval_rows("", results)}
    return out


def aligned(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the union of their columns (in first-seen order), None where a row has no value: runs
    evaluated on different tasks share one table."""
    columns = list(dict.fromkeys(c for row in rows for c in row))
    return [{c: row.get(c) for c in columns} for row in rows]


def forgetting_rows(runs: Iterable[tuple[str, Mapping[str, Any], RunResults]]) -> list[dict[str, Any]]:
    """Per (run, its metrics.json, its results): the slices, every change, and whether the general loss rose."""
    rows = []
    for run, metrics, results in runs:
        changes = forgetting_changes(metrics, results)
        general = changes["general loss change"]
        rows.append(
            {
                "run": run,
                "general set": f"test/{results.general_corpus}",
                "target set": f"test/{results.target_corpus}",
                **changes,
                "forgetting": None if general is None else general > 0,
            }
        )
    return aligned(rows)


def expert_list(experts: Sequence[int]) -> str:
    return " ".join(map(str, experts)) or "none"


def drift_rows(run: str, drift: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Per MoE layer of drift.json: divergence, changed expert sets, experts that moved, router entropy."""
    if drift is None:
        return []
    return [
        {
            "run": run,
            "layer": layer["layer"],
            "JS divergence": layer["js_divergence"],
            "changed expert sets": layer["changed_expert_set_fraction"],
            "gained": expert_list(layer["gained"]),
            "lost": expert_list(layer["lost"]),
            "entropy base": layer["entropy_base"],
            "entropy fine-tuned": layer["entropy_finetuned"],
            "entropy change": layer["entropy_change"],
            "tokens": drift["tokens"],
        }
        for layer in drift["layers"]
    ]
