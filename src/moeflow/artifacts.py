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

import csv
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .eval_results import (
    RunResults,
    aligned,
    drift_rows,
    eval_set,
    forgetting_changes,
    forgetting_rows,
    humaneval_rows,
    lm_eval_rows,
)
from .files import atomic_file, write_json, write_text

TABLE_FORMATS = ("csv", "md", "tex")
FIGURE_FORMATS = ("png", "pdf")


# --------------------------------------------------------------------------- cells and tables


def cell(value: Any, digits: int = 4) -> str:
    """One table cell as text: the same string in CSV, Markdown and LaTeX.

    Floats get ``digits`` decimals (large ones fewer significant places after the point), ints and
    strings are kept, booleans are yes/no, missing values are ``n/a``.
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        if abs(value) >= 1e5:
            return f"{value:.4g}" if abs(value) >= 1e12 else f"{value:.0f}"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.{max(digits - 1, 1)}e}"
        return f"{value:.{digits}f}"
    return str(value)


@dataclass
class Table:
    """A table as formatted cells; ``rows`` may hold raw values, which ``cells`` formats."""

    name: str
    caption: str
    columns: list[str]
    rows: list[list[Any]]
    digits: dict[str, int] = field(default_factory=dict)  # per-column decimals (default 4)

    def cells(self) -> list[list[str]]:
        return [[cell(v, self.digits.get(c, 4)) for c, v in zip(self.columns, row)] for row in self.rows]

    def numeric_columns(self, cells: list[list[str]]) -> list[bool]:
        """Columns whose cells are all numbers (or n/a, or ratios like 1.2x): right-aligned."""

        def is_number(text: str) -> bool:
            try:
                float(text.removesuffix("x"))
                return True
            except ValueError:
                return text in ("n/a", "")

        return [bool(cells) and all(is_number(row[i]) for row in cells) for i in range(len(self.columns))]

    def to_csv(self, provenance_line: str = "") -> str:
        buf = io.StringIO()
        if provenance_line:
            buf.write(f"# {provenance_line}\n")
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows(self.cells())
        return buf.getvalue()

    def to_markdown(self, provenance_line: str = "") -> str:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = [f"<!-- {provenance_line} -->"] if provenance_line else []
        lines += [f"**{self.caption}**", ""]
        lines.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
        cells = self.cells()
        lines.append("|" + "|".join("---:" if numeric else "---" for numeric in self.numeric_columns(cells)) + "|")
        lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"

    def to_latex(self, provenance_line: str = "") -> str:
        lines = [f"% {provenance_line}"] if provenance_line else []
        spec = "".join("r" if numeric else "l" for numeric in self.numeric_columns(self.cells()))
        lines += [
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{latex_escape(self.caption)}}}",
            f"\\label{{tab:{self.name}}}",
            f"\\begin{{tabular}}{{{spec}}}",
            "\\toprule",
            " & ".join(latex_escape(c) for c in self.columns) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in self.cells()]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def read_csv_table(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """Read a table written by ``write_table`` back (the provenance comment skipped)."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    rows = list(csv.reader(lines))
    return rows[0], rows[1:]


def write_table(table: Table, outdir: str | Path, provenance_line: str) -> list[Path]:
    """Write ``<name>.csv``, ``.md`` and ``.tex`` atomically; return the paths."""
    outdir = Path(outdir)
    renderers = {"csv": table.to_csv, "md": table.to_markdown, "tex": table.to_latex}
    paths = []
    for ext in TABLE_FORMATS:
        path = outdir / f"{table.name}.{ext}"
        write_text(path, renderers[ext](provenance_line))
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- figures


def pyplot():
    """matplotlib's pyplot on the Agg backend with settings that keep figure bytes stable."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "moeflow", "pdf.compression": 6, "path.simplify": True, "figure.dpi": 100})
    return plt


def save_figure(fig, outdir: str | Path, name: str, provenance_line: str, dpi: int = 150) -> list[Path]:
    """Save ``fig`` as ``<name>.png`` and ``<name>.pdf`` with fixed metadata; close it; return the paths."""
    outdir = Path(outdir)
    metadata = {
        "png": {"Software": None, "Description": provenance_line},
        "pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None, "Subject": provenance_line},
    }
    paths = []
    for ext in FIGURE_FORMATS:
        path = outdir / f"{name}.{ext}"
        with atomic_file(path, "wb") as fh:
            fig.savefig(fh, format=ext, dpi=dpi, metadata=metadata[ext], bbox_inches="tight")
        paths.append(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


# --------------------------------------------------------------------------- provenance


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def config_hash(config: Mapping[str, Any]) -> str:
    from .config import stable_hash

    return stable_hash(config, length=16)


def stage_provenance(docs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``provenance`` record of each upstream output (label -> record), for outputs that have one."""
    return {
        label: doc["provenance"]
        for label, doc in sorted(docs.items())
        if isinstance(doc, Mapping) and "provenance" in doc
    }


def manifest_fingerprint(manifest_path: str | Path) -> str:
    """A data manifest's fingerprint: the hash of its bytes (it records sources, tokenizer and counts)."""
    return sha256_file(manifest_path)[:16]


def provenance_record(
    config: Mapping[str, Any],
    stages: Mapping[str, Mapping[str, Any]],
    env_report: str | Path,
    manifests: Mapping[str, str | Path],
) -> dict[str, Any]:
    """What every artifact carries: config hash, each upstream stage's code version and provenance,
    the environment report's hash, and the data manifests' fingerprints."""
    return {
        "config_hash": config_hash(config),
        "stages": {label: dict(p) for label, p in sorted(stages.items())},
        "code_versions": sorted({p["moeflow_code"] for p in stages.values() if "moeflow_code" in p}),
        "environment_report": sha256_file(env_report)[:16],
        "data_manifests": {label: manifest_fingerprint(p) for label, p in sorted(manifests.items())},
    }


def provenance_line(record: Mapping[str, Any]) -> str:
    """One line that identifies a provenance record (embedded in every artifact)."""
    data = ",".join(f"{k}={v}" for k, v in record["data_manifests"].items())
    record_id = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return (
        f"moeflow provenance {record_id}: config {record['config_hash']}; code {'+'.join(record['code_versions'])}; "
        f"env {record['environment_report']}; data {data} (full record: provenance.json)"
    )


def write_provenance(
    path: str | Path, record: Mapping[str, Any], artifacts: Iterable[str | Path], root: str | Path
) -> None:
    """``provenance.json``: the record plus the SHA-256 of every artifact, by path relative to ``root``."""
    files = {Path(p).relative_to(root).as_posix(): sha256_file(p) for p in sorted(map(str, artifacts))}
    write_json(path, {**record, "artifacts": files})


def as_dict_rows(table: Table) -> list[dict[str, str]]:
    """The formatted rows as dicts keyed by column (what the CSV holds)."""
    return [dict(zip(table.columns, row)) for row in table.cells()]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def times(x: float | None) -> str:
    """A ratio as table text, e.g. ``0.53x``."""
    return "n/a" if x is None else f"{x:.2f}x"


def last(values: Sequence[Any]) -> Any:
    return values[-1] if values else None


# --------------------------------------------------------------------------- training logs


@dataclass
class TrainLog:
    """A run's training metrics.jsonl, as arrays over logged optimizer steps."""

    steps: list[int]
    tokens: list[int]  # tokens trained up to and including each step
    loss: list[float]
    ce: list[float]
    lr: list[float]
    tokens_per_s: list[float]  # measured steps only: steps replayed from a checkpoint carry no timings
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


# --------------------------------------------------------------------------- tables


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


@dataclass
class RunRecord:
    """What the MoE-vs-dense comparison reads for one run."""

    name: str
    metrics: Mapping[str, Any]  # evaluate's metrics.json
    speed: Mapping[str, Any]  # evaluate's speed.json
    log: TrainLog  # training's metrics.jsonl
    benchmark: Mapping[str, float | None]  # the training job's Snakemake benchmark
    # train_model's adapter/trainable_parameters.json (moeflow.lora.save_adapter_output):
    # method, trainable and total parameters
    training: Mapping[str, Any] = field(default_factory=dict)
    results: RunResults = field(default_factory=RunResults)  # lm-eval, HumanEval and routing drift


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


# --------------------------------------------------------------------------- task scores, pass@k, forgetting, drift

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
    return Table(
        name="humaneval",
        caption="HumanEval of every run with evaluate.humaneval on: greedy pass@1 and pass@k of the sampled "
        "completions (unbiased estimator) of the base and the fine-tuned model, and the change.",
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


# --------------------------------------------------------------------------- figures


def _colors(names: Sequence[str]) -> dict[str, Any]:
    plt = pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(sorted(names))}


def _plot_losses(ax, logs: Mapping[str, TrainLog]) -> None:
    colors = _colors(list(logs))
    for run, log in sorted(logs.items()):
        ax.plot(log.tokens, log.ce, color=colors[run], lw=1.2, label=f"{run}: training CE")
        if log.val_tokens:
            ax.plot(
                log.val_tokens,
                log.val_loss,
                color=colors[run],
                ls="--",
                marker="o",
                ms=4,
                label=f"{run}: validation loss",
            )
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def loss_figure(logs: Mapping[str, TrainLog]):
    """Training cross-entropy and validation loss (coverage validation set) against tokens, per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    _plot_losses(ax, logs)
    ax.set_title("Fine-tuning: training and validation loss")
    return fig


def lr_figure(logs: Mapping[str, TrainLog]):
    """The learning rate of every optimizer step (warmup, then cosine decay), per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    colors = _colors(list(logs))
    styles = ("-", "--", ":", "-.")
    for i, (run, log) in enumerate(sorted(logs.items())):  # styles differ: runs with one recipe overlap
        ax.plot(log.steps, log.lr, color=colors[run], ls=styles[i % len(styles)], lw=1.5 + 0.5 * (i == 0), label=run)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Learning-rate schedule")
    return fig


def expert_load_figure(run: str, log: TrainLog):
    """Per MoE layer: each expert's share of the layer's top-k assignments at every logged step."""
    import numpy as np

    plt = pyplot()
    loads = np.asarray(log.loads, dtype=np.float64)  # (steps, layers, experts)
    steps, layers, experts = loads.shape
    shares = loads / np.clip(loads.sum(-1, keepdims=True), 1, None)
    fig, axes = plt.subplots(layers, 1, figsize=(6.4, 1.0 + 1.3 * layers), sharex=True, squeeze=False)
    vmax = float(shares.max()) if shares.size else 1.0
    extent = (log.steps[0] - 0.5, log.steps[-1] + 0.5, experts - 0.5, -0.5)
    for layer in range(layers):
        ax = axes[layer, 0]
        image = ax.imshow(
            shares[:, layer, :].T,
            aspect="auto",
            cmap="viridis",
            vmin=0.0,
            vmax=vmax,
            extent=extent,
            interpolation="nearest",
        )
        ax.set_ylabel(f"layer {layer}\nexpert")
        if experts <= 16:
            ax.set_yticks(range(experts))
        ax.tick_params(axis="y", labelsize=6)
    axes[-1, 0].set_xlabel("optimizer step")
    bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.04, pad=0.02)
    bar.set_label(f"share of layer's assignments (uniform = {1 / experts:.3f})")
    fig.suptitle(f"Expert load during training, run '{run}'")
    return fig


def coverage_figure(coverage: Mapping[str, Any]):
    """The coverage validation set per (layer, expert), and how many cells and expert pairs it and random
    subsets of the same token count leave below the threshold (from the coverage stage's coverage.json)."""
    import numpy as np

    plt = pyplot()
    min_docs = int(coverage["settings"]["min_docs_per_expert"])
    layers = [layer["layer"] for layer in coverage["layers"]]
    docs = np.asarray([layer["docs"] for layer in coverage["layers"]], dtype=np.int64)
    fig, (heat, bars) = plt.subplots(
        1, 2, figsize=(11.0, 1.8 + 0.45 * len(layers)), gridspec_kw={"width_ratios": [3, 2]}
    )
    image = heat.imshow(docs, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    below_l, below_e = np.nonzero(docs < min_docs)
    heat.scatter(below_e, below_l, marker="x", color="red", s=20, label=f"below {min_docs} documents")
    heat.set_xlabel("expert")
    heat.set_ylabel("MoE layer")
    heat.set_xticks(range(docs.shape[1]))
    heat.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    heat.set_title(
        "Validation set: documents per (layer, expert)\n"
        f"({coverage['valset']['docs']} documents, {coverage['valset']['tokens']:,} tokens)",
        fontsize=10,
    )
    fig.colorbar(image, ax=heat, label="documents routing >= min_tokens tokens there")
    if docs.size <= 256:  # small enough to print each count
        for (layer, expert), n in np.ndenumerate(docs):
            heat.text(
                expert,
                layer,
                str(n),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if n < docs.max() / 2 else "black",
            )
    if len(below_l):
        heat.legend(fontsize=8, loc="upper right")
    random = coverage["random_comparison"]
    kinds = ["cells", "pairs"]
    x = np.arange(len(kinds))
    ours = [coverage["valset"]["cells_below"], coverage["valset"]["pairs_below"]]
    means = [random[f"{k}_below"]["mean"] for k in kinds]
    spread = np.array(
        [[m - random[f"{k}_below"]["min"], random[f"{k}_below"]["max"] - m] for k, m in zip(kinds, means)]
    ).T
    b1 = bars.bar(x - 0.2, ours, width=0.4, label="coverage validation set")
    b2 = bars.bar(
        x + 0.2, means, width=0.4, yerr=spread, capsize=4, label=f"random subsets (mean, min-max of {random['draws']})"
    )
    bars.bar_label(b1, fontsize=8)
    bars.bar_label(b2, labels=[f"{m:.1f}" for m in means], fontsize=8, padding=2)
    bars.set_ylim(0, max(ours + [m + e for m, e in zip(means, spread[1])] + [1]) * 1.25)
    bars.set_xticks(x, ["(layer, expert) cells", "top expert pairs"])
    bars.set_ylabel(f"constraints below {min_docs} documents (count)")
    bars.set_title("Left below the threshold, same token count", fontsize=10)
    bars.legend(fontsize=8)
    fig.tight_layout()
    return fig


def coverage_heatmap(
    path: str | Path, layers: Sequence[int], valset_docs: Any, random_docs: Any, min_docs: int
) -> None:
    """The coverage stage's heatmap.png, layers x experts: documents meeting each cell, the validation set
    beside a random subset of the same size; cells below the threshold are marked. Deterministic bytes
    (no timestamps, no software tag). The counts are (L, E) integer arrays."""
    import numpy as np

    plt = pyplot()
    vmax = max(2 * min_docs, 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.35 * len(layers)), sharey=True, constrained_layout=True)
    for ax, counts, title in (
        (axes[0], valset_docs, "coverage validation set"),
        (axes[1], random_docs, "random subset, same tokens"),
    ):
        image = ax.imshow(
            np.minimum(counts, vmax), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest"
        )
        below_l, below_e = np.nonzero(counts < min_docs)
        ax.scatter(below_e, below_l, marker="x", color="red", s=12, linewidths=0.8)
        ax.set_title(f"{title}: {len(below_l)} cells below {min_docs} docs", fontsize=10)
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    axes[0].set_ylabel("MoE layer (decoder index)")
    fig.colorbar(image, ax=axes, label=f"documents (capped at {vmax})")
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


def comparison_figure(records: Sequence[RunRecord]):
    """MoE vs dense: loss against tokens, training throughput and peak memory side by side."""
    plt = pyplot()
    rows = comparison_rows(records)
    fig, axes = plt.subplots(1, 3, figsize=(12.0, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    _plot_losses(axes[0], {r.name: r.log for r in records})
    axes[0].set_title("Loss against tokens")
    colors = _colors([r["run"] for r in rows])
    names = [r["run"] for r in rows]
    for ax, key, label in (
        (axes[1], "train tokens/s", "training throughput (tokens/s)"),
        (axes[2], "train peak MiB", "peak memory in training (MiB)"),
    ):
        values = [r[key] or 0.0 for r in rows]
        bars = ax.bar(names, values, color=[colors[n] for n in names])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_ylabel(label)
        ax.set_xlabel("run")
        ax.set_ylim(0, max(values + [1.0]) * 1.15)
        ax.set_title(label.split(" (")[0].capitalize())
    fig.suptitle("MoE vs dense (same data, token budget and recipe)")
    fig.tight_layout()
    return fig


def drift_figure(records: Sequence[RunRecord]):
    """Per MoE run, a heat map layers x experts of the change in each expert's load share from the base to
    the fine-tuned router; experts that gained (+) or lost (-) more than half their load are marked."""
    import numpy as np

    plt = pyplot()
    drifts = [(r.name, r.results.drift) for r in records if r.results.drift is not None]
    fig, axes = plt.subplots(
        1, max(len(drifts), 1), figsize=(4.8 * max(len(drifts), 1) + 1.2, 3.0), squeeze=False, constrained_layout=True
    )
    if not drifts:
        axes[0, 0].text(0.5, 0.5, "no MoE run: no routing drift", ha="center", va="center")
        axes[0, 0].set_axis_off()
        return fig
    load = lambda d, model: np.asarray([layer[f"load_{model}"] for layer in d["layers"]])  # noqa: E731
    changes = {run: 100 * (load(d, "finetuned") - load(d, "base")) for run, d in drifts}
    vmax = max(max(float(np.abs(c).max()) for c in changes.values()), 1e-9)
    for ax, (run, d) in zip(axes[0], drifts):
        image = ax.imshow(changes[run], aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        for row, layer in enumerate(d["layers"]):
            for expert, mark in [(e, "+") for e in layer["gained"]] + [(e, "\u2212") for e in layer["lost"]]:
                ax.text(expert, row, mark, ha="center", va="center", fontsize=10, fontweight="bold")
        labels = [
            f"layer {layer['layer']}\nJS {layer['js_divergence']:.3f}, "
            f"{layer['changed_expert_set_fraction']:.0%} sets changed"
            for layer in d["layers"]
        ]
        ax.set_yticks(range(len(d["layers"])), labels, fontsize=7)
        ax.set_xticks(range(changes[run].shape[1]))
        ax.set_xlabel("expert")
        ax.set_title(f"run '{run}' ({d['tokens']:,} tokens)", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="load share change (percentage points)")
    fig.suptitle("Routing drift: base to fine-tuned router")
    return fig


# --------------------------------------------------------------------------- the paper stage


FIGURES = ("loss_vs_tokens", "lr_schedule", "expert_load", "coverage", "moe_vs_dense", "routing_drift")
TABLES = (
    "final_metrics",
    "experts",
    "balance",
    "environment",
    "moe_vs_dense",
    "lora_vs_full",
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


def write_paper(
    outdir: str | Path,
    *,
    config: Mapping[str, Any],
    settings: Mapping[str, Any],
    records: Mapping[str, RunRecord],
    coverage: Mapping[str, Any],
    env_report_path: str | Path,
    manifests: Mapping[str, str | Path],
    stage_docs: Mapping[str, Any],
    experts: Mapping[str, Mapping[str, Any]],
) -> list[Path]:
    """Write every figure and table of ``paper_outputs`` plus ``provenance.json``; return the artifacts.

    ``settings``: the config's ``paper`` section (``moe_run``, ``dense_runs``, ``set``, ``dpi``);
    ``records``: each run's comparison inputs; ``coverage``: the MoE run's ``coverage.json``;
    ``stage_docs``: upstream JSON outputs (their ``provenance`` records are collected); ``experts``: each run's
    experts timings (rule choose_experts), for the environment table.
    """
    outdir = Path(outdir)
    record = provenance_record(config, stage_provenance(stage_docs), env_report_path, manifests)
    line = provenance_line(record)
    env_report = json.loads(Path(env_report_path).read_text(encoding="utf-8"))
    evals = {run: r.metrics for run, r in records.items()}
    moe, dense = settings["moe_run"], list(settings["dense_runs"])
    compared = [records[moe]] + [records[d] for d in dense]
    runs = list(records.values())
    dpi = int(settings["dpi"])

    artifacts: list[Path] = []
    for table in (
        final_metrics_table(evals),
        expert_table(evals, settings["set"]),
        balance_table(evals, settings["set"]),
        environment_table(env_report, config, record, experts),
        comparison_table(compared, moe),
        method_table(runs, moe),
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
    write_provenance(outdir / "provenance.json", record, artifacts, outdir)
    return artifacts
