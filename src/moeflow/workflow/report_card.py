"""The report card a finished ``train`` or ``paper`` prints: per run, losses, routing, memory, paths.

It is printed from the Snakefile's ``onsuccess`` and kept as ``results/<stack>/report_card.md``. Per run: the
loss before and after fine-tuning on each evaluation set, routing health (dead experts, balance, the warmup
gate's verdict), the memory plan's verdict and each phase's plan against its measured peak, and where the model,
the logs and the paper are.

Rendered as plain text (Markdown that reads as it is in a terminal) from the files the stages wrote, never
by running anything: a stage the run does not have (a dense run's router, HumanEval turned off, a target
that does not evaluate) is said so, and an expected file that is not there is named, not a crash. Only the
Snakefile's handler calls this (it is no rule's input: editing it reruns nothing).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.paper.eval_results import pass_at_k
from moeflow.paper.inputs import TrainLog, read_benchmark, read_train_log
from moeflow.plan.memory import PHASES
from moeflow.runtime.files import write_text
from moeflow.train.peak_memory import PHASE_PEAKS_FILE

# The targets that end with a card (Snakemake's default target is train).
CARD_TARGETS = ("train", "paper")
MIB = 2**20
PLAN_TOLERANCE = 0.15  # a measured phase peak within 1 +- this of the memory plan's (issue #38)


@dataclass(frozen=True)
class RunFiles:
    """Where one run's stage outputs are (the Snakefile's paths, common.smk). ``evaluation`` is None when the
    target does not evaluate; ``lm_eval`` (task -> model -> path) and ``humaneval`` (model -> path) are empty
    when the run has no tasks or HumanEval is off; ``drift`` is None for a run without a router, ``serve`` where
    serve.python is null (no serving check)."""

    run: str
    moe: bool
    plan: str
    warmup: str
    model: str
    train_logs: str
    train_log: str
    train_benchmark: str
    evaluation: str | None = None
    lm_eval: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    humaneval: Mapping[str, str] = field(default_factory=dict)
    drift: str | None = None
    serve: str | None = None


@dataclass(frozen=True)
class CardFiles:
    """The card's inputs: the stack, the stage the target stands for (``train`` or ``paper``), every run's
    files, the paper folder (``paper`` only), the logs folder, and ``noise``: (paper.moe_run, paper.noise_run)
    when the paper measures the seed noise (``paper`` only)."""

    stack: str
    stage: str
    runs: Sequence[RunFiles]
    logs: str
    paper: str | None = None
    noise: tuple[str, str] | None = None


def card_stage(targets: Iterable[str], default_target: str | None) -> str | None:
    """The card a finished Snakemake invocation gets: ``paper`` if a target is ``paper``, ``train`` for
    ``train`` (or no target: the default, ``default_target``); None when a target is anything else (a file,
    ``verify_env``, ``evaluate``): that run gets no card."""
    named = set(targets) or ({default_target} if default_target else set())
    if not named or not named <= set(CARD_TARGETS):
        return None
    return "paper" if "paper" in named else "train"


class Sources:
    """Reads the card's files; remembers the expected ones that are missing, to name them."""

    def __init__(self) -> None:
        self.missing: list[str] = []

    def exists(self, path: str) -> bool:
        if Path(path).exists():
            return True
        self.missing.append(path)
        return False

    def json(self, path: str) -> Any:
        return json.loads(Path(path).read_text(encoding="utf-8")) if self.exists(path) else None

    def train_log(self, path: str) -> TrainLog | None:
        return read_train_log(path) if self.exists(path) else None

    def benchmark(self, path: str) -> Mapping[str, float | None] | None:
        return read_benchmark(path) if self.exists(path) else None


def number(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def signed(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}"


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MIB:.1f} MiB"


def missing_line(what: str, path: str) -> str:
    return f"- {what}: **missing** `{path}` (the stage's output is not there: rerun the target)"


# --------------------------------------------------------------------------- losses


def evaluation_lines(files: RunFiles, stage: str, metrics: Mapping[str, Any] | None) -> list[str]:
    """Base vs fine-tuned loss on each evaluation set (evaluate_run's metrics.json)."""
    if files.evaluation is None:
        return [
            f"- evaluation sets: not evaluated by target `{stage}` (`snakemake paper` compares base and fine-tuned)"
        ]
    if metrics is None:
        return [missing_line("evaluation sets", files.evaluation)]
    lines = [
        "",
        "| set | targeted | base loss | fine-tuned loss | change | forgetting |",
        "|---|---|---|---|---|---|",
    ]
    for s in metrics["sets"]:
        lines.append(
            f"| {s['name']} | {'yes' if s['targeted'] else 'no'} | {number(s['base']['loss'])} "
            f"| {number(s['finetuned']['loss'])} | {signed(s['change'].get('loss'))} "
            f"| {'yes' if s['forgetting'] else 'no'} |"
        )
    return [*lines, ""]


def training_lines(log: TrainLog | None, files: RunFiles) -> list[str]:
    """Training's own cross-entropy, first to last logged step, and the validation set's loss during training."""
    if log is None:
        return [missing_line("training log", f"{files.train_logs}/metrics.jsonl")]
    if not log.steps:
        return [f"- training: no step logged in `{files.train_logs}/metrics.jsonl`"]
    line = (
        f"- training: {log.steps[-1]} steps, {log.tokens[-1]:,} tokens; train cross-entropy {number(log.ce[0])} "
        f"(step {log.steps[0]}) -> {number(log.ce[-1])} (step {log.steps[-1]})"
    )
    if log.val_steps:
        evals = ", ".join(f"{number(loss)} (step {step})" for step, loss in zip(log.val_steps, log.val_loss))
        line += f"; validation set loss {evals}"
    return [line]


# --------------------------------------------------------------------------- routing


def gate_line(report: Mapping[str, Any] | None, files: RunFiles) -> str:
    """The warmup's routing-stability gate (warmup's routing_report.json)."""
    if report is None:
        return missing_line("routing gate", f"{files.warmup}/routing_report.json")
    verdict = "stable" if report["stable"] else "UNSTABLE: " + "; ".join(report["problems"])
    return (
        f"- routing gate after warmup (step {report['step']}, window {report['window_steps']} steps, "
        f"reference {report['thresholds']['reference']}): {verdict}"
    )


def health_line(label: str, layers: Sequence[Mapping[str, Any]]) -> str:
    """Dead experts and balance per MoE layer (``layer_health`` records, the MoE layers in order)."""
    dead = sum(len(h["dead_experts"]) for h in layers)
    experts = sum(len(h["load"]) for h in layers)
    cells = "; ".join(
        f"MoE layer {i} max/mean load {number(h['max_over_mean'], 2)}, load entropy {number(h['load_entropy'], 3)}"
        + (f", dead {' '.join(map(str, h['dead_experts']))}" if h["dead_experts"] else "")
        for i, h in enumerate(layers)
    )
    return f"- {label}: {dead} of {experts} experts dead; {cells}"


def eval_balance_line(metrics: Mapping[str, Any] | None) -> list[str]:
    """Dead experts and balance on the first set with expert tables, base -> fine-tuned (metrics.json)."""
    routed = next((s for s in (metrics or {}).get("sets", []) if "experts" in s["finetuned"]), None)
    if routed is None:
        return []
    cells = []
    for b, f in zip(routed["base"]["experts"], routed["finetuned"]["experts"]):
        bb, fb = b["balance"], f["balance"]
        cells.append(
            f"layer {b['layer']} dead {len(bb['dead_experts'])} -> {len(fb['dead_experts'])}, "
            f"max/mean {number(bb['max_over_mean'], 2)} -> {number(fb['max_over_mean'], 2)}"
        )
    return [f"- evaluation on `{routed['name']}`, base -> fine-tuned: " + "; ".join(cells)]


def drift_line(files: RunFiles, src: Sources) -> list[str]:
    if files.evaluation is None or files.drift is None:
        return []
    drift = src.json(files.drift)
    if drift is None:
        return [missing_line("routing drift", files.drift)]
    cells = ", ".join(f"layer {layer['layer']} {number(layer['js_divergence'])}" for layer in drift["layers"])
    return [f"- routing drift (JS divergence of the expert loads): {cells}"]


def routing_lines(
    files: RunFiles, summary: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None, src: Sources
) -> list[str]:
    """The gate's verdict, the end of training's health, the evaluation's balance and the drift."""
    if not files.moe:
        return ["- routing: a dense model (no router)"]
    lines = [gate_line(src.json(f"{files.warmup}/routing_report.json"), files)]
    if summary is not None:
        lines.append(health_line("end of training (the guard's window)", summary["routing"]["layers"]))
        alarms, guard = summary["alarms"], summary["routing"]
        verdict = "stable" if guard["stable"] else "unstable: " + "; ".join(guard["problems"])
        listed = f" ({'; '.join(alarms)})" if alarms else ""
        lines.append(f"- routing alarms during training: {len(alarms)}{listed}; the guard at the end: {verdict}")
    return [*lines, *eval_balance_line(metrics), *drift_line(files, src)]


# --------------------------------------------------------------------------- memory


def memory_lines(files: RunFiles, log: TrainLog | None, src: Sources) -> list[str]:
    """The plan's verdict and its step total per device, beside the measured peak of training's steps."""
    plan = src.json(files.plan)
    if plan is None:
        return [missing_line("memory plan", files.plan)]
    device = plan["job"]["device"]
    planned = plan["per_device_bytes"]["total"]
    usable = plan["usable_fraction"] * plan["device_memory_bytes"]
    lines = [
        f"- memory plan: {plan['verdict'].replace('_', ' ')} (worst phase {plan['worst_phase']}); step "
        f"{size(planned)} per {device} device of {size(usable)} usable"
    ]
    if log is not None and log.memory_mib:
        peak = max(log.memory_mib) * MIB
        what = "allocator peak" if device == "cuda" else "resident set of the process"
        verdict = "within the plan" if peak <= planned else f"{peak / planned:.2f} x the plan's {size(planned)}"
        lines.append(f"- measured peak of a training step: {size(peak)} ({what}), {verdict}")
    bench = src.benchmark(files.train_benchmark)
    if bench is not None and bench["max_rss_mib"] is not None:
        lines.append(f"- train_model job's peak RSS: {size(bench['max_rss_mib'] * MIB)}")
    peaks_file = f"{files.train_logs}/{PHASE_PEAKS_FILE}"
    measured = src.json(peaks_file)
    if measured is None:
        return [*lines, missing_line("measured memory per phase", peaks_file)]
    lines += [
        f"- each phase, planned per rank against the largest rank's peak in warmup or train_model (`{peaks_file}`; "
        f"outside 1 +- {PLAN_TOLERANCE:g} is marked):",
        "",
        "| phase | planned | measured | measured / planned |",
        "|---|---|---|---|",
    ]
    for phase, planned, peak in phase_comparison(plan, measured):
        ratio = peak / planned
        mark = "" if abs(ratio - 1) <= PLAN_TOLERANCE else " (outside)"
        lines.append(f"| {phase} | {size(planned)} | {size(peak)} | {ratio:.2f}{mark} |")
    return [*lines, ""]


def phase_comparison(plan: Mapping[str, Any], measured: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """(phase, planned bytes per rank, measured peak of the largest rank, in warmup or train_model) for every phase
    of the plan that the run measured (moeflow.train.peak_memory). Planned: on CUDA the device's total less its
    runtime (the CUDA context, which the allocator's peak never holds); on the CPU the device and host sides together,
    the rank's resident set."""
    peaks: dict[str, int] = {}
    for stage in measured.get("stages", {}).values():
        for phase, per_rank in stage.items():
            peaks[phase] = max(peaks.get(phase, 0), *per_rank)
    rows = []
    for phase in PHASES:
        if phase not in peaks or phase not in plan["phases"]:
            continue
        device, host = plan["phases"][phase]["device_bytes"], plan["phases"][phase]["host_bytes"]
        if measured["device"] == "cuda":  # the allocator never sees the CUDA context the runtime term stands for
            total = device["total"] - device.get("runtime", 0)
        else:
            total = device["total"] + host["total"]
        rows.append((phase, total, peaks[phase]))
    return rows


# --------------------------------------------------------------------------- tasks


def lm_eval_lines(files: RunFiles, src: Sources) -> list[str]:
    if files.evaluation is None:
        return []
    if not files.lm_eval:
        return ["- lm-eval: no tasks (evaluate.tasks is empty)"]
    lines = []
    for task, by_model in files.lm_eval.items():
        docs = {model: src.json(path) for model, path in by_model.items()}
        gone = [path for model, path in by_model.items() if docs[model] is None]
        if gone:
            lines.append(missing_line(f"lm-eval {task}", ", ".join(gone)))
            continue
        cells = ", ".join(
            f"{metric} {number(docs['base']['metrics'][metric]['value'])} -> "
            f"{number(docs['finetuned']['metrics'][metric]['value'])}"
            for metric in sorted(docs["base"]["metrics"])
        )
        engines = sorted({doc.get("engine", {}).get("name", "hf") for doc in docs.values()})
        through = "" if engines == ["hf"] else f" (through {' and '.join(engines)})"
        lines.append(f"- lm-eval `{task}`{through}, base -> fine-tuned: {cells}")
    return lines


def humaneval_lines(files: RunFiles, src: Sources) -> list[str]:
    if files.evaluation is None:
        return []
    if not files.humaneval:
        return ["- HumanEval: not run (evaluate.humaneval.enabled is off)"]
    docs = {model: src.json(path) for model, path in files.humaneval.items()}
    gone = [path for model, path in files.humaneval.items() if docs[model] is None]
    if gone:
        return [missing_line("HumanEval", ", ".join(gone))]
    base, tuned = pass_at_k(docs["base"]), pass_at_k(docs["finetuned"])
    cells = ", ".join(f"{m} {number(base[m], 3)} -> {number(tuned[m], 3)}" for m in base)
    return [f"- HumanEval ({len(docs['finetuned']['problems'])} problems), base -> fine-tuned: {cells}"]


def serve_lines(files: RunFiles, src: Sources) -> list[str]:
    """The serving check's verdict: the engine, the largest log-prob difference and the top-token agreement."""
    if files.evaluation is None:
        return []
    if files.serve is None:
        return [
            "- serving check: not run (serve.python is null: `make serve-env`, then --configfile config/serve.yaml)"
        ]
    record = src.json(files.serve)
    if record is None:
        return [missing_line("serving check", files.serve)]
    if not record["checked"]:
        return [f"- serving check: {record['model_type']} not checked here: {record['reason']}"]
    lines = [
        f"- serving check, {record['engine']} {record['engine_version']} ({record['engine_device']}, "
        f"{record['dtype']}) against moeflow on {record['sequences']} validation segments: largest |log-prob "
        f"difference| {record['max_abs_logprob_diff']:.2g} (tolerance {record['tolerance']:g}), top token the same "
        f"at {record['top_token_agreement']:.1%} of {record['top_token_positions']} positions"
    ]
    adapter = record.get("adapter")
    if adapter:
        lines.append(
            f"- serving adapter read by {adapter['read_by']}'s adapter loader: {adapter['modules']} modules as "
            f"written, {adapter['stacked_moe_layers']} MoE layers stacked (`runs/{files.run}/serve/adapter`)"
        )
    return lines


# --------------------------------------------------------------------------- the card


def run_section(files: RunFiles, card: CardFiles, src: Sources) -> list[str]:
    """One run's part of the card."""
    log = src.train_log(f"{files.train_logs}/metrics.jsonl")
    summary = src.json(f"{files.train_logs}/summary.json")
    metrics = src.json(files.evaluation) if files.evaluation is not None else None
    src.exists(files.model)
    lines = [f"## run `{files.run}` ({'MoE' if files.moe else 'dense'})", "", "Loss (cross-entropy per token):"]
    lines += [*evaluation_lines(files, card.stage, metrics), *training_lines(log, files), "", "Routing:"]
    lines += [*routing_lines(files, summary, metrics, src), "", "Memory:", *memory_lines(files, log, src)]
    tasks = lm_eval_lines(files, src) + humaneval_lines(files, src)
    lines += ["", "Tasks:", *tasks] if tasks else []
    serving = serve_lines(files, src)
    lines += ["", "Serving:", *serving] if serving else []
    lines += [
        "",
        "Where:",
        f"- model: `{files.model}`",
        f"- training logs (TensorBoard, metrics.jsonl): `{files.train_logs}`",
    ]
    return [*lines, f"- train_model's log: `{files.train_log}`", ""]


def noise_lines(card: CardFiles, src: Sources) -> list[str]:
    """The seed noise: per evaluation set, how far the loss change of paper.moe_run and of its reseeded twin
    (paper.noise_run) lie apart, and each run's change on the fine-tuned slice against it."""
    if card.noise is None:
        return []
    moe, twin = card.noise
    metrics = {f.run: src.json(f.evaluation) for f in card.runs if f.evaluation}  # each file read once
    changes = {run: {s["name"]: s["change"].get("loss") for s in m["sets"]} for run, m in metrics.items() if m}
    if moe not in changes or twin not in changes:
        return []
    noise = {
        name: abs(a - b)
        for name, a in changes[moe].items()
        if (b := changes[twin].get(name)) is not None and a is not None
    }
    cells = ", ".join(f"{name} {number(value)}" for name, value in noise.items())
    lines = ["## seed noise", "", f"`{moe}` against `{twin}` (one config but the seed), |loss change|: {cells}"]
    targeted = next((s["name"] for s in metrics[moe]["sets"] if s["targeted"] and s["name"] != "valset"), None)
    if targeted in noise:
        verdicts = []
        for run, change in ((run, sets.get(targeted)) for run, sets in changes.items() if run != twin):
            if change is not None:
                beyond = "beyond" if abs(change) > noise[targeted] else "within"
                verdicts.append(f"`{run}` {signed(change)} ({beyond})")
        lines.append(
            f"- {targeted}, each run's change against the noise {number(noise[targeted])}: {', '.join(verdicts)}"
        )
    return [*lines, ""]


def render_card(card: CardFiles) -> str:
    """The card as text, from the files ``card`` names; the expected files that are missing are listed last."""
    src = Sources()
    lines = [f"# moeflow report card: target `{card.stage}`, stack `{card.stack}`", ""]
    for files in card.runs:
        lines += run_section(files, card, src)
    lines += noise_lines(card, src)
    if card.paper is not None:
        src.exists(f"{card.paper}/provenance.json")
        lines += [f"Paper: `{card.paper}` (figures/, tables/, provenance.json)"]
    lines += [f"Stage logs: `{card.logs}/<rule>/`"]
    if src.missing:
        lines += ["", "Missing expected files:", *(f"- `{path}`" for path in dict.fromkeys(src.missing))]
    return "\n".join(lines) + "\n"


def write_card(card: CardFiles, path: str | Path) -> str:
    """Render the card, keep it at ``path`` and return its text."""
    text = render_card(card)
    write_text(path, text)
    return text
