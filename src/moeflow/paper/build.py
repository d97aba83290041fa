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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeflow.paper.comparisons import comparison_table, forgetting_table, method_table, methods_table
from moeflow.paper.eval_results import drift_rows, eval_set, humaneval_rows, lm_eval_rows
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
    with_caption,
)
from moeflow.paper.findings import (
    balance_finding,
    caption_finding,
    coverage_finding,
    drift_finding,
    environment_finding,
    expert_finding,
    expert_load_finding,
    final_metrics_finding,
    humaneval_finding,
    lm_eval_finding,
    loss_finding,
    lr_finding,
    seed_noise_finding,
)
from moeflow.paper.inputs import RunRecord
from moeflow.paper.noise import noise_line, seed_noise, seed_noise_table, without_twin
from moeflow.paper.provenance import provenance_line, provenance_record, stage_provenance, write_provenance
from moeflow.paper.tables import TABLE_FORMATS, Table, write_table


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
    ).found(final_metrics_finding)


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
    ).found(expert_finding, set_name)


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
    ).found(balance_finding)


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
    noise: str = "",
) -> Table:
    """The environment and config summary every number in the paper was made with; ``experts``: each run's
    experts timings (rule choose_experts); ``noise``: the seed noise's runs (moeflow.paper.noise.noise_line)."""
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
        *([["seed noise", noise]] if noise else []),
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
    table = Table(name="environment", caption="Environment and configuration.", columns=["item", "value"], rows=rows)
    return table.found(environment_finding)


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
    ).found(lm_eval_finding)


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
    ).found(humaneval_finding)


def drift_table(records: Sequence[RunRecord]) -> Table:
    """Per (MoE run, layer): routing drift from the base to the fine-tuned router (drift.json)."""
    rows = [row for r in records for row in drift_rows(r.name, r.results.drift)]
    return Table(
        name="routing_drift",
        caption="Routing drift per MoE layer on the coverage validation set: Jensen-Shannon divergence (bits) of the "
        "expert-load distributions of the base and the fine-tuned router, the fraction of tokens whose chosen expert "
        "set changed, the experts that gained or lost more than half their load, and the mean router entropy "
        "(nats) per token. " + drift_finding(rows),
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
    "seed_noise",
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
    evaluation set of the per-expert and balance tables, the PNGs' resolution, and the MoE run's reseeded twin
    whose distance from it is the seed noise, None: not measured)."""

    moe_run: str
    dense_runs: tuple[str, ...]
    set: str
    dpi: int
    noise_run: str | None = None


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
    noise = seed_noise(records, moe, settings.noise_run, config)
    compared = [records[moe]] + [records[d] for d in dense]
    runs = list(records.values())
    shown = without_twin(runs, noise)  # the comparisons' runs: the seed-noise run is no method of its own
    dpi = settings.dpi
    comparison, methods = comparison_table(compared, moe, noise), methods_table(shown, moe, noise)
    drift = drift_table(runs)
    twin = noise.record if noise is not None else None

    artifacts: list[Path] = []
    for table in (
        final_metrics_table(evals),
        expert_table(evals, settings.set),
        balance_table(evals, settings.set),
        environment_table(env_report, config, record, experts, noise_line(noise)),
        comparison,
        method_table(shown, moe, noise),
        methods,
        forgetting_table(shown, noise),
        lm_eval_table(runs),
        humaneval_table(runs),
        drift,
        seed_noise_table(noise, records[moe], seed_noise_finding(records[moe], twin)),
    ):
        artifacts += write_table(table, outdir / "tables", line)

    figures = outdir / "figures"
    logs = {run: r.log for run, r in records.items()}
    for name, figure, text in (  # one figure at a time, each captioned with its finding
        ("loss_vs_tokens", lambda: loss_figure(logs), loss_finding(logs)),
        ("lr_schedule", lambda: lr_figure(logs), lr_finding(logs)),
        ("expert_load", lambda: expert_load_figure(moe, records[moe].log), expert_load_finding(moe, records[moe].log)),
        ("coverage", lambda: coverage_figure(coverage), coverage_finding(coverage)),
        ("moe_vs_dense", lambda: comparison_figure(compared), caption_finding(comparison)),
        ("routing_drift", lambda: drift_figure(runs), caption_finding(drift)),
        ("methods", lambda: methods_figure(shown), caption_finding(methods)),
    ):
        artifacts += save_figure(with_caption(figure(), text), figures, name, line, dpi)
    write_provenance(outdir / "provenance.json", record, artifacts, outdir)
    return artifacts
