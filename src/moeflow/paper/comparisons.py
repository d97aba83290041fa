"""The paper's comparison tables: MoE vs dense, LoRA vs full, the training methods and forgetting.

Each compares runs with the paper's MoE run (``paper.moe_run``). With a seed-noise run (``paper.noise_run``,
moeflow.paper.noise) the rows are computed for it too, but it is shown as no row of its own: its distance from the
MoE run is the seed noise, under the runs as a row, and each difference from the MoE run is shown with whether it
exceeds that noise. Every caption ends with the finding of its numbers (moeflow.paper.findings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moeflow.paper.eval_results import aligned, forgetting_changes, forgetting_rows
from moeflow.paper.findings import (
    comparison_finding,
    forgetting_finding,
    lora_vs_full_finding,
    methods_finding,
)
from moeflow.paper.inputs import RunRecord, comparison_rows, last, method_comparison_rows, training_cost
from moeflow.paper.noise import (
    NOT_MEASURED,
    SeedNoise,
    beyond,
    change_columns,
    noise_caption,
    noise_label,
    noise_rows,
    noise_values,
    seeds_text,
    split_twin,
    with_twin,
)
from moeflow.paper.tables import Table


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def times(x: float | None) -> str:
    """A ratio as table text, e.g. ``0.53x``."""
    return "n/a" if x is None else f"{x:.2f}x"


def rows_with_ratios(
    rows: Sequence[Mapping[str, Any]],
    reference: str,
    ratio_columns: Sequence[str],
    compared: Callable[[Mapping, Mapping], bool],
) -> tuple[list[str], list[list[Any]]]:
    """Columns and table rows: one row per run, then for each run that ``compared(run, reference row)``
    selects, its ratio to the ``reference`` run in ``ratio_columns``."""
    columns = list(rows[0]) if rows else ["run"]
    ref = next((r for r in rows if r["run"] == reference), None)
    table_rows = [[r[c] for c in columns] for r in rows]
    if ref is not None:
        for r in rows:
            if compared(r, ref):
                table_rows.append(
                    [f"{r['run']} / {reference}"]
                    + [times(ratio(r[c], ref[c])) if c in ratio_columns else "" for c in columns[1:]]
                )
    return columns, table_rows


def compared_table(
    rows: Sequence[Mapping[str, Any]],
    twin: Mapping[str, Any] | None,
    reference: str,
    ratio_columns: Sequence[str],
    compared: Callable[[Mapping, Mapping], bool],
    measured: Sequence[str],
    noise: SeedNoise | None,
) -> tuple[list[str], list[list[Any]], dict[str, float | None]]:
    """Columns, the rows with their ratio rows and seed-noise rows (``noise_rows``), and the noise per measured
    column (the ``measured`` columns and every change column)."""
    columns, table_rows = rows_with_ratios(rows, reference, ratio_columns, compared)
    measured = [*measured, *change_columns(columns)]
    table_rows += noise_rows(columns, rows, reference, compared, measured, noise, twin)
    return columns, table_rows, noise_values(rows, reference, twin, measured)


COMPARISON_RATIOS = ("train tokens/s", "train peak MiB", "train job peak RSS MiB", "eval tokens/s", "eval peak MiB")


def comparison_table(records: Sequence[RunRecord], reference: str, noise: SeedNoise | None = None) -> Table:
    """The MoE-vs-dense table: one row per run, then each other run's ratio to ``reference`` (the MoE run), and with
    a seed-noise run the noise and each difference against it."""
    rows, twin = split_twin(comparison_rows(with_twin(records, noise)), noise)
    columns, table_rows, values = compared_table(
        rows,
        twin,
        reference,
        COMPARISON_RATIOS,
        lambda r, ref: r["run"] != reference,
        ("final train CE", "val loss"),
        noise,
    )
    return Table(
        name="moe_vs_dense",
        caption="MoE vs dense on the same data, token budget and recipe: parameters, tokens trained, final training "
        "cross-entropy and validation loss (nats/token), median training throughput (tokens/s), peak memory "
        "(MiB; step-end RSS on CPU or allocated memory on CUDA, and the training job's peak RSS), evaluation "
        f"throughput and peak memory, and the base-to-fine-tuned changes of the forgetting table. {FORGETTING_NOTE} "
        f"Ratio rows divide by the MoE run. {noise_caption(noise, reference)} "
        + comparison_finding(rows, reference, values),
        columns=columns,
        rows=table_rows,
        digits={
            "train tokens/s": 0,
            "eval tokens/s": 0,
            "train peak MiB": 0,
            "train job peak RSS MiB": 0,
            "eval peak MiB": 0,
        },
    )


def value_at_tokens(tokens: Sequence[int], values: Sequence[float], budget: int) -> float | None:
    """The value logged at the last point with at most ``budget`` tokens trained (None if there is none)."""
    picked = None
    for t, v in zip(tokens, values):
        if t <= budget:
            picked = v
    return picked


def method_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per run: training method, trainable parameters, cost, the losses reached after the same number of
    tokens (the fewest any run trained), so runs of different lengths compare at equal data, and the
    forgetting table's changes."""
    budget = min((last(r.log.tokens) or 0 for r in records), default=0)
    out = []
    for r in records:
        t = r.training
        out.append(
            {
                "run": r.name,
                "method": t.get("method"),
                "trainable params": t.get("trainable"),
                "total params": t.get("total"),
                "trainable %": 100.0 * t["trainable_fraction"] if "trainable_fraction" in t else None,
                **training_cost(r),
                "tokens compared": budget,
                "train CE at tokens": value_at_tokens(r.log.tokens, r.log.ce, budget),
                "val loss at tokens": value_at_tokens(r.log.val_tokens, r.log.val_loss, budget),
                **forgetting_changes(r.metrics, r.results),
            }
        )
    return aligned(out)


METHOD_RATIOS = ("trainable params", "train tokens/s", "train peak MiB", "train job peak RSS MiB")


def method_table(records: Sequence[RunRecord], reference: str, noise: SeedNoise | None = None) -> Table:
    """The LoRA-vs-full table: one row per run, then each run trained by another method than ``reference``
    (the paper's MoE run) as a ratio to it, and with a seed-noise run the noise and each difference against it."""
    rows, twin = split_twin(method_rows(with_twin(records, noise)), noise)
    columns, table_rows, values = compared_table(
        rows,
        twin,
        reference,
        METHOD_RATIOS,
        lambda r, ref: r["method"] != ref["method"],
        ("train CE at tokens", "val loss at tokens"),
        noise,
    )
    return Table(
        name="lora_vs_full",
        caption="LoRA vs full fine-tuning of every run: trainable and total parameters, median training throughput "
        "(tokens/s), peak memory (MiB; step-end RSS on CPU or allocated memory on CUDA, and the training job's "
        "peak RSS), the training cross-entropy and validation loss (nats/token) at the last logged step "
        "within the tokens every run trained, and the base-to-fine-tuned changes of the forgetting table. "
        f"{FORGETTING_NOTE} Ratio rows divide by the MoE run. {noise_caption(noise, reference)} "
        + lora_vs_full_finding(rows, reference, values),
        columns=columns,
        rows=table_rows,
        digits={"trainable %": 2, "train tokens/s": 0, "train peak MiB": 0, "train job peak RSS MiB": 0},
    )


METHODS_MEASURED = (
    "target loss before",
    "target loss after",
    "target gain",
    "general loss before",
    "general loss after",
    "general forgetting",
    "routing JS divergence",
    "changed expert sets",
)


def methods_table(records: Sequence[RunRecord], reference: str | None = None, noise: SeedNoise | None = None) -> Table:
    """The methods comparison: per MoE run, target-slice gain against general-slice forgetting, with trainable
    parameters, optimizer-state memory, step time and routing drift (inputs.method_comparison_rows), and with a
    seed-noise run each difference from ``reference`` (the MoE run; None: the first row) against the noise. With
    one training method among the runs the caption says there is nothing to compare; with no MoE run it has no rows."""
    rows, twin = split_twin(method_comparison_rows(with_twin(records, noise)), noise)
    reference = reference if reference is not None else (rows[0]["run"] if rows else "")
    columns = list(rows[0]) if rows else ["run", "method"]
    table_rows = [[row[c] for c in columns] for row in rows]
    table_rows += noise_rows(
        columns, rows, reference, lambda r, ref: r["run"] != reference, METHODS_MEASURED, noise, twin
    )
    methods = sorted({str(r["method"]) for r in rows})
    note = (
        ""
        if len(methods) > 1
        else f" Only one training method ({', '.join(methods) or 'no MoE run'}): nothing to compare; add runs with "
        "another train.method (full, lora, esft), as config/config.yaml's model_from_config runs do."
    )
    return Table(
        name="methods",
        caption="Training methods on the same base model and data: loss (nats/token) on the test split of the "
        "target slice (data.finetune_corpus) and of the general slice (data.base_corpus) before and after "
        "fine-tuning; gain = target before - after, forgetting = general after - before (positive: forgotten); "
        "trainable parameters (updated ones: ESFT's unselected experts excluded), the optimizer state's MiB (all "
        "ranks), the median optimizer step's seconds, and routing drift on the coverage validation set (mean over "
        f"MoE layers of the JS divergence, bits, and of the fraction of tokens whose expert set changed).{note} "
        f"{noise_caption(noise, reference)} "
        + methods_finding(rows, reference, noise_values(rows, reference, twin, METHODS_MEASURED)),
        columns=columns,
        rows=table_rows,
        digits={"trainable %": 2, "optimizer state MiB": 2, "step s": 3},
    )


FORGETTING_NOTE = (
    "General = the test split of data.base_corpus, target = that of data.finetune_corpus; a rise in loss is "
    "worse, a rise in a task score or pass@k better."
)


BEYOND_COLUMNS = {
    "general loss change": "general change beyond seed noise",
    "target loss change": "target change beyond seed noise",
}


def forgetting_table(records: Sequence[RunRecord], noise: SeedNoise | None = None) -> Table:
    """Per run: the base-to-fine-tuned change on the general slice beside the target slice (loss), each
    lm-eval task's metrics and pass@k; columns only for what some run was evaluated on. With a seed-noise run
    (the MoE run reseeded), a row of the noise of each change and, per run, whether its loss changes exceed it."""
    rows, twin = split_twin(forgetting_rows((r.name, r.metrics, r.results) for r in with_twin(records, noise)), noise)
    columns = list(rows[0]) if rows else ["run"]
    table_rows = [[row[c] for c in columns] for row in rows]
    values = noise_values(rows, noise.run if noise is not None else "", twin, change_columns(columns))
    sentence = NOT_MEASURED
    if noise is not None and twin is not None and rows:
        beyond_columns = [BEYOND_COLUMNS[c] for c in BEYOND_COLUMNS if c in columns]
        table_rows = [
            row + [beyond(r[c], values[c]) for c in BEYOND_COLUMNS if c in columns] for row, r in zip(table_rows, rows)
        ]
        table_rows.append([noise_label(noise)] + [values.get(c, "") for c in columns[1:]] + [""] * len(beyond_columns))
        columns = columns + beyond_columns
        sentence = (
            f"Seed noise: row '{noise_label(noise)}' holds the absolute difference between {noise.run} and "
            f"{noise.twin} in each change ({seeds_text(noise)}); "
            "the columns '... beyond seed noise' say whether a run's loss change on the slice exceeds it (yes) or not "
            f"(no); {noise.twin} is no row of its own (table seed_noise has its numbers)."
        )
    return Table(
        name="forgetting",
        caption="Forgetting: the change from the base to the fine-tuned model of every run, loss (nats/token) on the "
        f"general and on the target slice, each lm-eval task's metrics and HumanEval pass@k. {FORGETTING_NOTE} "
        f"'forgetting' = the general slice's loss rose. {sentence} " + forgetting_finding(rows, values),
        columns=columns,
        rows=table_rows,
    )
