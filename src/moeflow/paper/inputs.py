"""What the paper reads of each run: training log, resource benchmark, evaluation results.

The resource benchmark is the job's; the module also holds the per-run rows the tables and figures share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.paper.eval_results import (
    RunResults,
    aligned,
    eval_set,
    forgetting_changes,
)


def last(values: Sequence[Any]) -> Any:
    return values[-1] if values else None


@dataclass
class TrainLog:
    """A run's training metrics.jsonl, as arrays over logged optimizer steps."""

    steps: list[int]
    tokens: list[int]  # tokens trained up to and including each step
    loss: list[float]
    ce: list[float]
    lr: list[float]
    tokens_per_s: list[float]  # measured steps only: steps replayed from a checkpoint carry no timings
    step_seconds: list[float]  # the same measured steps' wall time per optimizer step
    memory_mib: list[float]
    loads: list[list[list[int]]]  # per step, per MoE layer, per expert: top-k assignments
    val_steps: list[int]
    val_tokens: list[int]
    val_loss: list[float]

    @property
    def is_moe(self) -> bool:
        return any(self.loads)


def read_train_log(path: str | Path) -> TrainLog:
    """Parse training's ``metrics.jsonl`` (``kind: train`` and ``kind: eval`` records, by step).

    A record is kept once per step (a resumed run's log repeats its history first, without timings);
    tokens are summed over every step so the x axis is tokens trained.
    """
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                record = json.loads(line)
                (train if record.get("kind", "train") == "train" else evals)[int(record["step"])] = record
    steps = sorted(train)
    tokens, total = [], 0
    cumulative: dict[int, int] = {}
    for step in steps:
        total += int(train[step]["tokens"])
        tokens.append(total)
        cumulative[step] = total
    val_steps = sorted(s for s in evals if s in cumulative)
    return TrainLog(
        steps=steps,
        tokens=tokens,
        loss=[float(train[s]["loss"]) for s in steps],
        ce=[float(train[s]["ce"]) for s in steps],
        lr=[float(train[s]["lr"]) for s in steps],
        tokens_per_s=[float(train[s]["tokens_per_s"]) for s in steps if "tokens_per_s" in train[s]],
        step_seconds=[float(train[s]["seconds"]) for s in steps if "seconds" in train[s]],
        memory_mib=[float(train[s]["memory_mib"]) for s in steps if "memory_mib" in train[s]],
        loads=[[list(map(int, layer["load"])) for layer in train[s].get("routing", [])] for s in steps],
        val_steps=val_steps,
        val_tokens=[cumulative[s] for s in val_steps],
        val_loss=[float(evals[s]["loss"]) for s in val_steps],
    )


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def read_benchmark(path: str | Path) -> dict[str, float]:
    """A Snakemake ``benchmark:`` TSV (one row): wall seconds and peak RSS (MiB) of the whole job."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    row = dict(zip(lines[0].split("\t"), lines[1].split("\t")))
    as_float = lambda k: float(row[k]) if row.get(k, "NA") not in ("NA", "-", "") else None  # noqa: E731
    return {"seconds": as_float("s"), "max_rss_mib": as_float("max_rss")}


@dataclass
class RunRecord:
    """What the MoE-vs-dense comparison reads for one run."""

    name: str
    metrics: Mapping[str, Any]  # evaluate's metrics.json
    speed: Mapping[str, Any]  # evaluate's speed.json
    log: TrainLog  # training's metrics.jsonl
    benchmark: Mapping[str, float | None]  # the training job's Snakemake benchmark
    # train_model's adapter/trainable_parameters.json (moeflow.model.lora.save_adapter_output):
    # method, trainable and total parameters
    training: Mapping[str, Any] = field(default_factory=dict)
    results: RunResults = field(default_factory=RunResults)  # lm-eval, HumanEval and routing drift
    summary: Mapping[str, Any] = field(default_factory=dict)  # train_model's summary.json (optimizer_state_bytes)


def training_cost(r: RunRecord) -> dict[str, float | None]:
    """Median training throughput, peak step-end memory and the training job's peak RSS of one run."""
    return {
        "train tokens/s": median(r.log.tokens_per_s),
        "train peak MiB": max(r.log.memory_mib) if r.log.memory_mib else None,
        "train job peak RSS MiB": r.benchmark.get("max_rss_mib"),
    }


def comparison_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per run: parameters, tokens trained, losses, training and evaluation throughput and peak memory, and
    the forgetting table's changes."""
    out = []
    for r in records:
        valset = eval_set(r.metrics, "valset")
        out.append(
            {
                "run": r.name,
                "total params": r.metrics["parameters"]["total"],
                "active params/token": r.metrics["parameters"]["active_per_token"],
                "tokens trained": last(r.log.tokens),
                "final train CE": last(r.log.ce),
                "val loss": valset["finetuned"]["loss"] if valset else None,
                **training_cost(r),
                "eval tokens/s": r.speed["finetuned"]["tokens_per_s"],
                "eval peak MiB": r.speed["peak_memory_bytes"] / 2**20,
                **forgetting_changes(r.metrics, r.results),
            }
        )
    return aligned(out)


def slice_losses(metrics: Mapping[str, Any], corpus: str) -> tuple[float | None, float | None, float | None]:
    """The base and the fine-tuned loss on ``corpus``'s test split and evaluate_run's change between them
    (fine-tuned - base); None for what the run was not evaluated on."""
    s = eval_set(metrics, f"test/{corpus}")
    return (s["base"]["loss"], s["finetuned"]["loss"], s["change"].get("loss")) if s is not None else (None,) * 3


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def method_comparison_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per MoE run (the runs with routing drift): its training method, the target slice's loss before and after
    and the gain (before - after: positive is learning), the general slice's and the forgetting (after - before:
    positive is forgetting), trainable parameters, the optimizer state's MiB, the median optimizer step's seconds
    and the routing drift averaged over the MoE layers."""
    out = []
    for r in records:
        if r.results.drift is None:
            continue
        target_before, target_after, target_change = slice_losses(r.metrics, r.results.target_corpus)
        general_before, general_after, general_change = slice_losses(r.metrics, r.results.general_corpus)
        state = r.summary.get("optimizer_state_bytes")
        layers = r.results.drift["layers"]
        out.append(
            {
                "run": r.name,
                "method": r.training.get("method"),
                "target loss before": target_before,
                "target loss after": target_after,
                "target gain": None if target_change is None else -target_change,
                "general loss before": general_before,
                "general loss after": general_after,
                "general forgetting": general_change,
                "trainable params": r.training.get("trainable"),
                "trainable %": 100.0 * r.training["trainable_fraction"] if "trainable_fraction" in r.training else None,
                "optimizer state MiB": None if state is None else state / 2**20,
                "step s": median(r.log.step_seconds),
                "routing JS divergence": mean([layer["js_divergence"] for layer in layers]),
                "changed expert sets": mean([layer["changed_expert_set_fraction"] for layer in layers]),
            }
        )
    return out
