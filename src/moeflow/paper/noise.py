"""The seed noise of the paper's comparisons: each measure's |moe_run - noise_run| and the rows that state it.

``paper.noise_run`` is ``paper.moe_run`` with another seed and nothing else changed (the config check,
moeflow.workflow.checks.noise_run_problems, refuses any other run): its base model is pretrained again and its
fine-tune reseeded, on the same data and validation set. How far the two runs' numbers lie apart is how far a
difference between two methods or models can lie apart by chance of the seed alone. The comparison tables leave the
run out of their rows and state each difference they show against that noise; the ``seed_noise`` table lists the two
runs' numbers beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeflow.paper.eval_results import eval_set, forgetting_changes
from moeflow.paper.inputs import RunRecord, last, mean
from moeflow.paper.tables import Table


@dataclass(frozen=True)
class SeedNoise:
    """``paper.noise_run`` (``twin``) beside ``paper.moe_run`` (``run``), their seeds, and the twin's record."""

    run: str
    twin: str
    seeds: tuple[Any, Any]
    record: RunRecord


def run_seed(config: Mapping[str, Any], run: str) -> Any:
    """The seed of ``run``: its overlay's ``seed``, else the config's."""
    return ((config.get("runs") or {}).get(run) or {}).get("seed", config["seed"])


def seed_noise(
    records: Mapping[str, RunRecord], moe_run: str, noise_run: str | None, config: Mapping[str, Any]
) -> SeedNoise | None:
    """The seed noise of ``moe_run`` against ``noise_run`` (None when no noise run is configured)."""
    if noise_run is None:
        return None
    if noise_run not in records:
        raise ValueError(f"paper.noise_run {noise_run!r} has no results (runs: {', '.join(records)})")
    return SeedNoise(moe_run, noise_run, (run_seed(config, moe_run), run_seed(config, noise_run)), records[noise_run])


def without_twin(records: Sequence[RunRecord], noise: SeedNoise | None) -> list[RunRecord]:
    """The records a comparison shows: the noise run left out (it is no method or model of its own)."""
    return [r for r in records if noise is None or r.name != noise.twin]


def with_twin(records: Sequence[RunRecord], noise: SeedNoise | None) -> list[RunRecord]:
    """The records a comparison's rows are computed from: those shown and the noise run (last)."""
    return without_twin(records, noise) + ([noise.record] if noise is not None else [])


def split_twin(
    rows: Sequence[Mapping[str, Any]], noise: SeedNoise | None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows shown, and the noise run's row (None without one)."""
    twin = noise.twin if noise is not None else None
    return [dict(r) for r in rows if r["run"] != twin], next((dict(r) for r in rows if r["run"] == twin), None)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def difference(a: Any, b: Any) -> float | None:
    """``a - b`` where both are numbers, else None."""
    return a - b if is_number(a) and is_number(b) else None


def noise_values(
    rows: Sequence[Mapping[str, Any]], reference: str, twin_row: Mapping[str, Any] | None, columns: Sequence[str]
) -> dict[str, float | None]:
    """Per column: |reference's value - the noise run's| (None where either has none, or without a noise run)."""
    ref = next((r for r in rows if r["run"] == reference), None)
    out = {}
    for c in columns:
        d = difference(ref.get(c), twin_row.get(c)) if ref is not None and twin_row is not None else None
        out[c] = None if d is None else abs(d)
    return out


def beyond(diff: float | None, noise: float | None) -> bool | None:
    """Whether a difference exceeds the seed noise (None where either is unknown)."""
    return None if diff is None or noise is None else abs(diff) > noise


def change_columns(columns: Sequence[str]) -> list[str]:
    """The forgetting table's change columns among ``columns`` (loss per slice, task metrics, pass@k)."""
    return [c for c in columns if c.endswith(" change")]


def noise_rows(
    columns: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    reference: str,
    compared: Callable[[Mapping, Mapping], bool],
    measured: Sequence[str],
    noise: SeedNoise | None,
    twin_row: Mapping[str, Any] | None,
) -> list[list[Any]]:
    """Rows under a comparison table's: the seed noise of each ``measured`` column, then per run that ``compared``
    selects its difference from ``reference`` and whether that exceeds the noise (yes/no); none without a noise run."""
    ref = next((r for r in rows if r["run"] == reference), None)
    if noise is None or twin_row is None or ref is None:
        return []
    values = noise_values(rows, reference, twin_row, measured)
    line = lambda label, cells: [label] + [cells.get(c, "") for c in columns[1:]]  # noqa: E731
    out = [line(noise_label(noise), values)]
    for r in rows:
        if compared(r, ref):
            diffs = {c: difference(r.get(c), ref.get(c)) for c in measured}
            out.append(line(f"{r['run']} - {reference}", diffs))
            out.append(
                line(f"{r['run']} - {reference} beyond seed noise", {c: beyond(diffs[c], values[c]) for c in measured})
            )
    return out


NOT_MEASURED = (
    "The seed noise was not measured (paper.noise_run is null), so no difference here is set against it: add a run "
    "that is paper.moe_run with another seed, e.g. runs: {moe-seed2: {seed: 1235, coverage: {valset_of_run: moe}}}, "
    "and name it in paper.noise_run (config/config.yaml's model_from_config does)."
)


def noise_label(noise: SeedNoise) -> str:
    """The run column of a table's seed-noise row."""
    return f"seed noise: {noise.run} vs {noise.twin}"


def seeds_text(noise: SeedNoise) -> str:
    return (
        f"{noise.run} (seed {noise.seeds[0]}) against {noise.twin} (seed {noise.seeds[1]}), one config but for the "
        "seed: the base model pretrained again and the fine-tune reseeded, on the same data and validation set"
    )


def noise_caption(noise: SeedNoise | None, reference: str) -> str:
    """The caption's sentence on the seed noise of a table with difference rows (``noise_rows``)."""
    if noise is None:
        return NOT_MEASURED
    return (
        f"Seed noise: row '{noise_label(noise)}' holds the absolute difference between {noise.run} and {noise.twin} "
        f"in each loss and change column ({seeds_text(noise)}); rows '<run> - {reference}' hold each difference "
        f"from {reference}, and rows '<run> - {reference} beyond seed noise' say whether it exceeds that noise (yes) "
        f"or not (no); {noise.twin} is no row of its own (table seed_noise has its numbers)."
    )


def noise_line(noise: SeedNoise | None) -> str:
    """The environment table's line on the seed noise."""
    return "not measured (paper.noise_run: null)" if noise is None else seeds_text(noise)


SEED_NOISE_COLUMNS = ["measure", "set", "moe run", "noise run", "seed noise"]


def seed_noise_measures(moe: RunRecord, twin: RunRecord) -> list[list[Any]]:
    """Per measure: (measure, set, the MoE run's value, the noise run's, |difference|)."""
    rows = []

    def add(measure: str, set_name: str, a: Any, b: Any) -> None:
        d = difference(a, b)
        rows.append([measure, set_name, a, b, None if d is None else abs(d)])

    for s in moe.metrics["sets"]:
        t = eval_set(twin.metrics, s["name"])
        if t is None:
            continue
        add("loss before", s["name"], s["base"]["loss"], t["base"]["loss"])
        add("loss after", s["name"], s["finetuned"]["loss"], t["finetuned"]["loss"])
        add("loss change", s["name"], s["change"].get("loss"), t["change"].get("loss"))
    add("final train CE", "training", last(moe.log.ce), last(twin.log.ce))
    a, b = forgetting_changes(moe.metrics, moe.results), forgetting_changes(twin.metrics, twin.results)
    for column in a:
        if column not in ("general loss change", "target loss change"):  # the test sets' loss change above
            add(column, "", a[column], b.get(column))
    drifts = [r.results.drift for r in (moe, twin)]
    if all(d is not None for d in drifts):
        for key, label in (
            ("js_divergence", "routing JS divergence"),
            ("changed_expert_set_fraction", "changed expert sets"),
        ):
            add(label, "valset", *(mean([layer[key] for layer in d["layers"]]) for d in drifts))
    return rows


def seed_noise_table(noise: SeedNoise | None, moe: RunRecord | None, finding: str) -> Table:
    """Table ``seed_noise``: every measure of the MoE run and of its reseeded twin, and the noise between them."""
    rows = seed_noise_measures(moe, noise.record) if noise is not None and moe is not None else []
    if noise is None:
        caption = f"Seed noise. {NOT_MEASURED}"
    else:
        caption = (
            f"Seed noise: {seeds_text(noise)}. Each measure of both runs (moe run = {noise.run}, noise run = "
            f"{noise.twin}) and their absolute difference, the noise the MoE-vs-dense, LoRA-vs-full, methods and "
            "forgetting tables set their differences against: loss (nats/token) before and after fine-tuning and its "
            "change on each evaluation set, the final training cross-entropy, each lm-eval and HumanEval change, and "
            "the routing drift."
        )
    return Table(name="seed_noise", caption=f"{caption} {finding}", columns=SEED_NOISE_COLUMNS, rows=rows)
