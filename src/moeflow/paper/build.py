"""Paper artifacts: tables (CSV, Markdown, LaTeX), figures (PNG, PDF) and their provenance.

Everything is a function of cached stage outputs, never of a retraining. Reproducible by construction:

* tables are rendered from one list of already-formatted cells, so CSV, Markdown and LaTeX show the
  same digits, and the same inputs give the same bytes (no timestamps, sorted iteration);
* figures are saved with matplotlib's Agg backend and fixed metadata (no creation date, no software
  string; ``svg.hashsalt`` fixed), so PNG and PDF bytes are stable for the same inputs and versions;
* every artifact carries a provenance line: the code version each upstream stage recorded, a hash of
  the config, the environment report's hash and the data manifests' fingerprints
  (``provenance.json`` holds the full record and the SHA-256 of every artifact).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeflow.paper.eval_results import (
    aligned,
    drift_rows,
    eval_set,
    forgetting_changes,
    forgetting_rows,
    humaneval_rows,
    lm_eval_rows,
)
from moeflow.paper.figures import (
    FIGURE_FORMATS,
    comparison_figure,
    coverage_figure,
    drift_figure,
    expert_load_figure,
    loss_figure,
    lr_figure,
    methods_figure,
    save_figure,
)
from moeflow.paper.inputs import RunRecord, comparison_rows, last, method_comparison_rows, training_cost
from moeflow.paper.provenance import provenance_line, provenance_record, stage_provenance, write_provenance
from moeflow.paper.tables import TABLE_FORMATS, Table, write_table


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def times(x: float | None) -> str:
    """A ratio as table text, e.g. ``0.53x``."""
    return "n/a" if x is None else f"{x:.2f}x"


def final_metrics_table(evals: Mapping[str, Mapping[str, Any]]) -> Table:
    """Loss and perplexity per run and evaluation set, base vs fine-tuned (from each ``metrics.json``)."""
    rows = []
    for run, metrics in sorted(evals.items()):
        for s in metrics["sets"]:
            rows.append(
                [
                    run,
                    s["name"],
                    s["targeted"],
                    s["base"]["loss"],
                    s["finetuned"]["loss"],
                    s["change"].get("loss"),
                    s["base"]["perplexity"],
                    s["finetuned"]["perplexity"],
                    s["forgetting"],
                    s["finetuned"]["label_tokens"],
                ]
            )
    return Table(
        name="final_metrics",
        caption="Loss (token-normalised cross-entropy, nats/token) and perplexity of the base and the fine-tuned model "
        "on each evaluation set; forgetting = the loss rose on a set the fine-tune did not target.",
        columns=[
            "run",
            "set",
            "targeted",
            "base loss",
            "fine-tuned loss",
            "change",
            "base ppl",
            "fine-tuned ppl",
            "forgetting",
            "label tokens",
        ],
        rows=rows,
        digits={"base ppl": 2, "fine-tuned ppl": 2},
    )


def _expert_sets(
    evals: Mapping[str, Mapping[str, Any]], set_name: str
) -> Iterator[tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """(run, its metrics, its record of ``set_name``) for the runs, by name, whose record has expert
    statistics (MoE runs)."""
    for run, metrics in sorted(evals.items()):
        s = eval_set(metrics, set_name)
        if s is not None and "experts" in s["base"]:
            yield run, metrics, s


def expert_table(evals: Mapping[str, Mapping[str, Any]], set_name: str = "valset") -> Table:
    """Per (run, layer, expert): share of routed tokens and mean loss of the tokens served, before and after."""
    rows = []
    for run, metrics, s in _expert_sets(evals, set_name):
        below = {
            (c["layer"], c["expert"]) for c in (metrics.get("coverage_recheck") or {}).get("below_cells_after", [])
        }
        for b, f in zip(s["base"]["experts"], s["finetuned"]["experts"]):
            for e in range(len(b["tokens"])):
                rows.append(
                    [
                        run,
                        b["layer"],
                        e,
                        b["share"][e],
                        f["share"][e],
                        b["mean_loss"][e],
                        f["mean_loss"][e],
                        None
                        if b["mean_loss"][e] is None or f["mean_loss"][e] is None
                        else f["mean_loss"][e] - b["mean_loss"][e],
                        (b["layer"], e) in below,
                    ]
                )
    return Table(
        name="experts",
        caption=f"Per expert on the {set_name} set: share of the layer's top-k assignments and mean loss (nats/token) "
        "of the tokens it served, base vs fine-tuned; "
        "'below' = under the coverage threshold with the fine-tuned router.",
        columns=[
            "run",
            "layer",
            "expert",
            "base share",
            "fine-tuned share",
            "base loss",
            "fine-tuned loss",
            "loss change",
            "below",
        ],
        rows=rows,
    )


def balance_table(evals: Mapping[str, Mapping[str, Any]], set_name: str = "valset") -> Table:
    """Per (run, layer, model): max/mean load, coefficient of variation, normalised entropy, dead experts."""
    rows = []
    for run, _, s in _expert_sets(evals, set_name):
        for label in ("base", "finetuned"):
            for layer in s[label]["experts"]:
                bal = layer["balance"]
                rows.append(
                    [
                        run,
                        layer["layer"],
                        label,
                        bal["max_over_mean"],
                        bal["cv"],
                        bal["load_entropy"],
                        len(bal["dead_experts"]),
                    ]
                )
    return Table(
        name="balance",
        caption=f"Expert load balance per layer on the {set_name} set (1, 0, 1, 0 = perfectly balanced).",
        columns=["run", "layer", "model", "max/mean", "CV", "entropy (norm.)", "dead experts"],
        rows=rows,
        digits={"max/mean": 3, "CV": 3, "entropy (norm.)": 3},
    )


def experts_choice_line(timings: Mapping[str, Any]) -> str:
    """Rule choose_experts's choice in one line: the implementation, why, what was not eligible, the shape."""
    shape = timings["shape"]
    if shape is None:
        return f"none ({timings['reason']})"
    dropped = "; ".join(f"{n}: {r['reason']}" for n, r in timings["implementations"].items() if not r["eligible"])
    return (
        f"{timings['chosen']}: {timings['reason']}{'; not eligible: ' + dropped if dropped else ''} "
        f"[{shape['model_type']} layer {shape['layer']}: hidden {shape['hidden_size']}, expert width "
        f"{shape['expert_width']}, {shape['num_experts']} experts, top-{shape['top_k']}, {shape['tokens']} tokens, "
        f"{timings['device']}, {timings['precision']}]"
    )


def environment_table(
    env_report: Mapping[str, Any],
    config: Mapping[str, Any],
    record: Mapping[str, Any],
    experts: Mapping[str, Mapping[str, Any]],
) -> Table:
    """The environment and config summary every number in the paper was made with; ``experts``: each run's
    experts timings (rule choose_experts)."""
    system, torch_ = env_report.get("system", {}), env_report.get("torch", {})
    packages = env_report.get("packages", {})
    model = config["model"]["config"]
    train = config["train"]
    rows = [
        ["stack", env_report.get("stack")],
        ["python", system.get("python")],
        ["torch", torch_.get("version")],
        ["transformers", packages.get("transformers")],
        ["CUDA runtime", torch_.get("cuda_runtime")],
        ["GPUs", torch_.get("gpu_summary") or "none"],
        ["CPU", system.get("cpu_model")],
        ["CPUs usable", system.get("cpus_usable")],
        ["pins match", env_report.get("pins", {}).get("matches")],
        ["threads", config["threads"]],
        ["precision", config["precision"]],
        ["seed", config["seed"]],
        ["device", config["hardware"]["device"]],
        ["model type", model.get("model_type")],
        ["layers x hidden", f"{model.get('num_hidden_layers')} x {model.get('hidden_size')}"],
        ["experts (top-k)", f"{model.get('num_experts')} ({model.get('num_experts_per_tok')})"],
        ["attention", config["model"]["attn_implementation"]],
        *([f"experts implementation ({run})", experts_choice_line(timings)] for run, timings in experts.items()),
        ["sequence length", config["data"]["seq_len"]],
        ["micro-batch x accumulation", f"{train['micro_batch_size']} x {train['grad_accum_steps']}"],
        ["fine-tuning corpus", config["data"]["finetune_corpus"]],
        ["runs", ", ".join(sorted(config["runs"]))],
        ["config hash", record["config_hash"]],
        ["code versions", " ".join(record["code_versions"])],
        ["environment report", record["environment_report"]],
    ] + [[f"data manifest {label}", fp] for label, fp in record["data_manifests"].items()]
    return Table(name="environment", caption="Environment and configuration.", columns=["item", "value"], rows=rows)


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


COMPARISON_RATIOS = ("train tokens/s", "train peak MiB", "train job peak RSS MiB", "eval tokens/s", "eval peak MiB")


def comparison_table(records: Sequence[RunRecord], reference: str) -> Table:
    """The MoE-vs-dense table: one row per run, then each other run's ratio to ``reference`` (the MoE run)."""
    columns, table_rows = rows_with_ratios(
        comparison_rows(records), reference, COMPARISON_RATIOS, lambda r, ref: r["run"] != reference
    )
    return Table(
        name="moe_vs_dense",
        caption="MoE vs dense on the same data, token budget and recipe: parameters, tokens trained, final training "
        "cross-entropy and validation loss (nats/token), median training throughput (tokens/s), peak memory "
        "(MiB; step-end RSS on CPU or allocated memory on CUDA, and the training job's peak RSS), evaluation "
        f"throughput and peak memory, and the base-to-fine-tuned changes of the forgetting table. {FORGETTING_NOTE} "
        "Ratio rows divide by the MoE run.",
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


def method_table(records: Sequence[RunRecord], reference: str) -> Table:
    """The LoRA-vs-full table: one row per run, then each run trained by another method than ``reference``
    (the paper's MoE run) as a ratio to it."""
    columns, table_rows = rows_with_ratios(
        method_rows(records), reference, METHOD_RATIOS, lambda r, ref: r["method"] != ref["method"]
    )
    return Table(
        name="lora_vs_full",
        caption="LoRA vs full fine-tuning of every run: trainable and total parameters, median training throughput "
        "(tokens/s), peak memory (MiB; step-end RSS on CPU or allocated memory on CUDA, and the training job's "
        "peak RSS), the training cross-entropy and validation loss (nats/token) at the last logged step "
        "within the tokens every run trained, and the base-to-fine-tuned changes of the forgetting table. "
        f"{FORGETTING_NOTE} Ratio rows divide by the MoE run.",
        columns=columns,
        rows=table_rows,
        digits={"trainable %": 2, "train tokens/s": 0, "train peak MiB": 0, "train job peak RSS MiB": 0},
    )


def methods_table(records: Sequence[RunRecord]) -> Table:
    """The methods comparison: per MoE run, target-slice gain against general-slice forgetting, with trainable
    parameters, optimizer-state memory, step time and routing drift (inputs.method_comparison_rows). With one
    training method among the runs the caption says there is nothing to compare; with no MoE run it has no rows."""
    rows = method_comparison_rows(records)
    columns = list(rows[0]) if rows else ["run", "method"]
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
        f"MoE layers of the JS divergence, bits, and of the fraction of tokens whose expert set changed).{note}",
        columns=columns,
        rows=[[row[c] for c in columns] for row in rows],
        digits={"trainable %": 2, "optimizer state MiB": 2, "step s": 3},
    )


FORGETTING_NOTE = (
    "General = the test split of data.base_corpus, target = that of data.finetune_corpus; a rise in loss is "
    "worse, a rise in a task score or pass@k better."
)


LM_EVAL_COLUMNS = [
    "run",
    "task",
    "metric",
    "base",
    "base stderr",
    "fine-tuned",
    "fine-tuned stderr",
    "change",
    "samples",
]


HUMANEVAL_COLUMNS = ["run", "measure", "base", "fine-tuned", "change", "problems"]


DRIFT_COLUMNS = [
    "run",
    "layer",
    "JS divergence",
    "changed expert sets",
    "gained",
    "lost",
    "entropy base",
    "entropy fine-tuned",
    "entropy change",
    "tokens",
]


def lm_eval_table(records: Sequence[RunRecord]) -> Table:
    """Every lm-eval task of every run (evaluate.tasks): each metric, base vs fine-tuned, with standard errors."""
    rows = [row for r in records for row in lm_eval_rows(r.name, r.results)]
    return Table(
        name="lm_eval",
        caption="lm-evaluation-harness tasks (evaluate.tasks) of every run: each metric of the base and the fine-tuned "
        "model with lm-eval's standard error (n/a where lm-eval gives none), the change, and the samples scored.",
        columns=LM_EVAL_COLUMNS,
        rows=[[row[c] for c in LM_EVAL_COLUMNS] for row in rows],
    )


def humaneval_table(records: Sequence[RunRecord]) -> Table:
    """HumanEval pass@k of every run that ran it: greedy pass@1 and sampled pass@k, base vs fine-tuned."""
    rows = [row for r in records for row in humaneval_rows(r.name, r.results)]
    caption = (
        "HumanEval of every run with evaluate.humaneval on: greedy pass@1 and pass@k of the sampled "
        "completions (unbiased estimator) of the base and the fine-tuned model, and the change."
    )
    if not rows:
        caption = (
            "HumanEval was not run: evaluate.humaneval.enabled is off for every run. The embedded default turns it "
            "off: a model of a few million parameters writes no working Python, so its pass@k would say nothing."
        )
    return Table(
        name="humaneval",
        caption=caption,
        columns=HUMANEVAL_COLUMNS,
        rows=[[row[c] for c in HUMANEVAL_COLUMNS] for row in rows],
    )


def forgetting_table(records: Sequence[RunRecord]) -> Table:
    """Per run: the base-to-fine-tuned change on the general slice beside the target slice (loss), each
    lm-eval task's metrics and pass@k; columns only for what some run was evaluated on."""
    rows = forgetting_rows((r.name, r.metrics, r.results) for r in records)
    columns = list(rows[0]) if rows else ["run"]
    return Table(
        name="forgetting",
        caption="Forgetting: the change from the base to the fine-tuned model of every run, loss (nats/token) on the "
        f"general and on the target slice, each lm-eval task's metrics and HumanEval pass@k. {FORGETTING_NOTE} "
        "'forgetting' = the general slice's loss rose.",
        columns=columns,
        rows=[[row[c] for c in columns] for row in rows],
    )


def drift_table(records: Sequence[RunRecord]) -> Table:
    """Per (MoE run, layer): routing drift from the base to the fine-tuned router (drift.json)."""
    rows = [row for r in records for row in drift_rows(r.name, r.results.drift)]
    return Table(
        name="routing_drift",
        caption="Routing drift per MoE layer on the coverage validation set: Jensen-Shannon divergence (bits) of the "
        "expert-load distributions of the base and the fine-tuned router, the fraction of tokens whose chosen expert "
        "set changed, the experts that gained or lost more than half their load, and the mean router entropy "
        "(nats) per token.",
        columns=DRIFT_COLUMNS,
        rows=[[row[c] for c in DRIFT_COLUMNS] for row in rows],
    )


FIGURES = ("loss_vs_tokens", "lr_schedule", "expert_load", "coverage", "moe_vs_dense", "routing_drift", "methods")


TABLES = (
    "final_metrics",
    "experts",
    "balance",
    "environment",
    "moe_vs_dense",
    "lora_vs_full",
    "methods",
    "forgetting",
    "lm_eval",
    "humaneval",
    "routing_drift",
)


def paper_outputs(outdir: str) -> dict[str, str]:
    """Every file the paper stage writes, by a key the Snakemake rule names its outputs with."""
    out = {f"fig_{name}_{ext}": f"{outdir}/figures/{name}.{ext}" for name in FIGURES for ext in FIGURE_FORMATS}
    out |= {f"table_{name}_{ext}": f"{outdir}/tables/{name}.{ext}" for name in TABLES for ext in TABLE_FORMATS}
    out["provenance"] = f"{outdir}/provenance.json"
    return out


@dataclass(frozen=True)
class PaperStage:
    """Rule paper: the config's ``paper`` section (the MoE run reported, the dense runs it is compared with, the
    evaluation set of the per-expert and balance tables, the PNGs' resolution)."""

    moe_run: str
    dense_runs: tuple[str, ...]
    set: str
    dpi: int


def write_paper(
    outdir: str | Path,
    *,
    config: Mapping[str, Any],
    settings: PaperStage,
    records: Mapping[str, RunRecord],
    coverage: Mapping[str, Any],
    env_report_path: str | Path,
    manifests: Mapping[str, str | Path],
    stage_docs: Mapping[str, Any],
    experts: Mapping[str, Mapping[str, Any]],
) -> list[Path]:
    """Write every figure and table of ``paper_outputs`` plus ``provenance.json``; return the artifacts.

    ``records``: each run's comparison inputs; ``coverage``: the MoE run's ``coverage.json``;
    ``stage_docs``: upstream JSON outputs (their ``provenance`` records are collected); ``experts``: each run's
    experts timings (rule choose_experts), for the environment table.
    """
    outdir = Path(outdir)
    record = provenance_record(config, stage_provenance(stage_docs), env_report_path, manifests)
    line = provenance_line(record)
    env_report = json.loads(Path(env_report_path).read_text(encoding="utf-8"))
    evals = {run: r.metrics for run, r in records.items()}
    moe, dense = settings.moe_run, list(settings.dense_runs)
    compared = [records[moe]] + [records[d] for d in dense]
    runs = list(records.values())
    dpi = settings.dpi

    artifacts: list[Path] = []
    for table in (
        final_metrics_table(evals),
        expert_table(evals, settings.set),
        balance_table(evals, settings.set),
        environment_table(env_report, config, record, experts),
        comparison_table(compared, moe),
        method_table(runs, moe),
        methods_table(runs),
        forgetting_table(runs),
        lm_eval_table(runs),
        humaneval_table(runs),
        drift_table(runs),
    ):
        artifacts += write_table(table, outdir / "tables", line)

    figures = outdir / "figures"
    logs = {run: r.log for run, r in records.items()}
    artifacts += save_figure(loss_figure(logs), figures, "loss_vs_tokens", line, dpi)
    artifacts += save_figure(lr_figure(logs), figures, "lr_schedule", line, dpi)
    artifacts += save_figure(expert_load_figure(moe, records[moe].log), figures, "expert_load", line, dpi)
    artifacts += save_figure(coverage_figure(coverage), figures, "coverage", line, dpi)
    artifacts += save_figure(comparison_figure(compared), figures, "moe_vs_dense", line, dpi)
    artifacts += save_figure(drift_figure(runs), figures, "routing_drift", line, dpi)
    artifacts += save_figure(methods_figure(runs), figures, "methods", line, dpi)
    write_provenance(outdir / "provenance.json", record, artifacts, outdir)
    return artifacts
