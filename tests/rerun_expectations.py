"""What editing library code must rerun, by what the code means: the table of docs/reruns.md.

tests/pipeline/test_library_reruns.py edits every file these rows cover in a finished smoke pipeline and
checks that Snakemake reruns exactly a file's row (target ``paper``); tests/unit/test_rule_code.py checks
that the rows cover every file and that docs/reruns.md shows them. The rows are written from the code's
meaning, not from moeflow.workflow.rule_code's declarations, which they check.

Rewrite the docs' table after changing a row: ``python tests/rerun_expectations.py``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reruns.md"
TABLE_START = "<!-- code rerun table: written by tests/rerun_expectations.py -->"
TABLE_END = "<!-- end of the code rerun table -->"
EDITED = ("src/moeflow/**/*.py", "workflow/tasks/*")  # every file a row must cover

# The smoke pipeline's rules (target paper) in the order the docs list them.
RULE_ORDER = (
    "verify_env",
    "choose_experts",
    "train_tokenizer",
    "tokenize",
    "plan_memory",
    "pretrain_base",
    "coverage_valset",
    "warmup",
    "train_model",
    "evaluate_model",
    "evaluate_run",
    "lm_eval_task",
    "humaneval_generate",
    "humaneval_execute",
    "routing_drift",
    "serve_check",
    "paper",
)
# Rules of a run the smoke config does not have (train.method esft; lora, serving_adapter), so no row can name them;
# docs/reruns.md says what they rerun.
OUTSIDE_SMOKE = frozenset({"esft_routing", "esft_select", "serving_adapter"})
EVALUATION = frozenset(
    {"evaluate_model", "evaluate_run", "lm_eval_task", "humaneval_generate", "humaneval_execute", "routing_drift"}
)
# The serving check (serve.python set; the smoke pipeline has it where the serving environment is installed).
SERVING = frozenset({"serve_check"})
AFTER_FINE_TUNING = frozenset({"train_model", *EVALUATION, *SERVING, "paper"})  # what follows train_model
AFTER_BASE_MODEL = frozenset({"pretrain_base", "coverage_valset", "warmup", *AFTER_FINE_TUNING})


@dataclass(frozen=True)
class Row:
    code: str  # what the code does
    patterns: tuple[str, ...]  # files, relative to the repository root (fnmatch: * also crosses /)
    reruns: frozenset[str]


# Infrastructure (moeflow.workflow.rule_code.INFRASTRUCTURE): each module, and why an edit to it reruns nothing
# (tests/unit/test_rule_code.py checks that a stage's own code uses of it only the reviewed PLUMBING).
INFRASTRUCTURE = (
    (
        "src/moeflow/__init__.py",
        "the package root: its name; transformers 4.57 kept from importing scikit-learn (import time)",
    ),
    ("src/moeflow/runtime/__init__.py", "`runtime`'s package docstring"),
    (
        "src/moeflow/runtime/all_reduce_probe.py",
        "verify_env's all-reduce probe: whether collectives work here, a fact of the environment report",
    ),
    (
        "src/moeflow/runtime/compat.py",
        "the installed versions (the stack fixes them: results/<stack>) and the sklearn import skip",
    ),
    ("src/moeflow/runtime/devices.py", "claiming a job's GPUs: which GPU runs it, not what it computes"),
    (
        "src/moeflow/runtime/env.py",
        "the environment report and its pins check: facts, rerun by verify_env's fingerprint param",
    ),
    (
        "src/moeflow/runtime/figures.py",
        "matplotlib set up to render figures reproducibly: how a figure is drawn, no number in it",
    ),
    ("src/moeflow/runtime/files.py", "atomic, deterministic writes of what a stage computed"),
    ("src/moeflow/runtime/gpu_node.py", "verify_env's checks of a GPU node (driver, GPU count, NCCL)"),
    (
        "src/moeflow/runtime/host_copies.py",
        "a batch copied to the device a model computes on (through pinned memory on CUDA): the same values either way",
    ),
    (
        "src/moeflow/runtime/job.py",
        "the job a torchrun script reads: its params (Snakemake compares them), threads, log file",
    ),
    ("src/moeflow/runtime/pins.py", "the stacks' pip pins (envs/<stack>.yaml is the install's input)"),
    (
        "src/moeflow/runtime/stage.py",
        "a stage's start: logging, offline mode, torch's threads set to the job's, provenance, kill points",
    ),
    (
        "src/moeflow/settings.py",
        "the config schema's reader and typed settings: the values reach stages as params, which Snakemake compares",
    ),
    ("src/moeflow/workflow/__init__.py", "`workflow`'s package docstring"),
    ("src/moeflow/workflow/checks.py", "the config checks: they refuse a config, and compute nothing a stage writes"),
    ("src/moeflow/workflow/imports.py", "the import walk the tests use"),
    (
        "src/moeflow/workflow/keys.py",
        "the stage settings and keys: what a stage depends on reaches it as params or its output path",
    ),
    ("src/moeflow/workflow/load.py", "loading and merging the config: the merged values reach stages as params"),
    (
        "src/moeflow/workflow/merge.py",
        "merging the config's layers (a run's overlay, `precision: auto`): the values reach stages as params",
    ),
    (
        "src/moeflow/workflow/recipe.py",
        "advice for a copied recipe: its flags refused at config check, naming moeflow's keys",
    ),
    ("src/moeflow/workflow/report_card.py", "the report card the Snakefile prints after a run"),
    (
        "src/moeflow/workflow/method_table.py",
        "docs/training.md's which-method-on-which-hardware table: no stage runs it",
    ),
    (
        "src/moeflow/workflow/scaleout.py",
        "the planner's advice for a SLURM profile's layout and cost (docs/scaling-out.md): no stage runs it",
    ),
    (
        "src/moeflow/workflow/rule_settings.py",
        "each rule's settings from the config: they reach stages as params, which Snakemake compares",
    ),
    (
        "src/moeflow/workflow/rule_code.py",
        "each rule's declared code (this table's other side): a change of a declaration changes the rule's inputs",
    ),
)


# The first row whose pattern matches a file is that file's expectation.
ROWS = (
    Row("the paper's figures, tables and provenance", ("src/moeflow/paper/*",), frozenset({"paper"})),
    Row(
        "the serving engine's script and how it is run in the serving environment (the package's docstring)",
        ("src/moeflow/serving/engine.py", "src/moeflow/serving/process.py", "src/moeflow/serving/__init__.py"),
        frozenset({"serve_check", "humaneval_generate", "humaneval_execute", "lm_eval_task", "paper"}),
    ),
    Row(
        "lm-eval tasks through lm-eval's vLLM backend in the serving environment (evaluate.lm_eval.engine: vllm)",
        ("src/moeflow/serving/harness.py",),
        frozenset({"lm_eval_task", "paper"}),
    ),
    Row(
        "HumanEval's completions generated in the serving engine (evaluate.humaneval.engine: vllm)",
        ("src/moeflow/serving/generation.py",),
        frozenset({"humaneval_generate", "humaneval_execute", "paper"}),
    ),
    Row(
        "the serving check: the engine's log-probs against moeflow's forward, the tensors, the serving adapter",
        ("src/moeflow/serving/*",),
        frozenset({"serve_check", "paper"}),
    ),
    Row(
        "lm-eval: the run, moeflow's documents as requests, the task resolver; the task YAMLs and their code",
        ("src/moeflow/evaluation/lm_eval_*.py", "workflow/tasks/*"),
        frozenset({"lm_eval_task", "paper"}),
    ),
    Row(
        "the evaluation on sets (loss, perplexity, per-expert tables; lm-eval's cross-check uses it)",
        ("src/moeflow/evaluation/run_metrics.py",),
        frozenset({"evaluate_model", "evaluate_run", "routing_drift", "lm_eval_task", "paper"}),
    ),
    Row(
        "a run's base and fine-tuned model compared from their records (change per set, forgetting, coverage recheck)",
        ("src/moeflow/evaluation/comparison.py",),
        frozenset({"evaluate_run", "paper"}),
    ),
    Row(
        "routing drift, and the routing files evaluate_model keeps for it",
        ("src/moeflow/evaluation/drift.py", "src/moeflow/evaluation/token_routing.py"),
        frozenset({"evaluate_model", "evaluate_run", "routing_drift", "paper"}),
    ),
    Row(
        "HumanEval: problems, samples, pass@k; the generation loop",
        (
            "src/moeflow/evaluation/humaneval.py",
            "src/moeflow/evaluation/completions.py",
            "src/moeflow/evaluation/generation.py",
        ),
        frozenset({"humaneval_generate", "humaneval_execute", "paper"}),
    ),
    Row(
        "HumanEval's programs run in the sandbox",
        ("src/moeflow/evaluation/humaneval_execution.py", "src/moeflow/evaluation/sandbox*.py"),
        frozenset({"humaneval_execute", "paper"}),
    ),
    Row(
        "the coverage validation set and its format",
        ("src/moeflow/coverage/*", "src/moeflow/data/valset.py"),
        frozenset({"coverage_valset", *AFTER_FINE_TUNING}),
    ),
    Row(
        "the training plan, the configurations it proposes and its report (rule plan_memory; the forward-only "
        "stages' plans use none of them)",
        ("src/moeflow/plan/report.py", "src/moeflow/plan/proposals.py", "src/moeflow/plan/training_plan.py"),
        frozenset({"plan_memory", *AFTER_FINE_TUNING}),
    ),
    Row(
        "the memory planner's counts and per-rank memory, which the forward-only stages' plans use too",
        ("src/moeflow/plan/*",),
        frozenset({"plan_memory", "coverage_valset", *AFTER_FINE_TUNING}),
    ),
    Row(
        "the forward-only stages' typed settings and shared opening (layout, memory plan, the model in its dtype)",
        ("src/moeflow/stages/*",),
        frozenset({"coverage_valset", *AFTER_FINE_TUNING}),
    ),
    Row(
        "the experts implementation's timing",
        ("src/moeflow/model/experts_choice.py",),
        frozenset({"choose_experts", *AFTER_BASE_MODEL}),
    ),
    Row(
        "a model's transformers config and class, what moeflow knows about each family (moeflow.families), its "
        "typed settings, the folder checks",
        (
            "src/moeflow/model/__init__.py",
            "src/moeflow/model/configs.py",
            "src/moeflow/families/*",
            "src/moeflow/families/*/*",
            "src/moeflow/model/settings.py",
            "src/moeflow/model/folder.py",
        ),
        frozenset({"choose_experts", "plan_memory", *AFTER_BASE_MODEL}),
    ),
    Row(
        "the typed training and parallel settings, parameter categories (the planner reads them too)",
        (
            "src/moeflow/train/__init__.py",
            "src/moeflow/train/settings.py",
            "src/moeflow/parallel/__init__.py",
            "src/moeflow/parallel/settings.py",
            "src/moeflow/model/parameters.py",
        ),
        frozenset({"plan_memory", *AFTER_BASE_MODEL}),
    ),
    Row(
        "building and loading a model in every layout (whole, each rank's rows, FSDP, expert parallelism, "
        "LoRA, a quantized base), its chunked loss; sharding, gradients, ranks",
        (
            "src/moeflow/loading/*",
            "src/moeflow/model/activation_checkpointing.py",
            "src/moeflow/model/chunked_loss.py",
            "src/moeflow/model/mtp_loss.py",
            "src/moeflow/model/wrappers.py",
            "src/moeflow/model/lora.py",
            "src/moeflow/model/expert_lora.py",
            "src/moeflow/model/lora_merge.py",
            "src/moeflow/model/adapter_layout.py",
            "src/moeflow/model/quantization.py",
            "src/moeflow/model/quantized_experts.py",
            "src/moeflow/model/saved_names.py",
            "src/moeflow/parallel/*",
            "src/moeflow/model/safetensors_files.py",
        ),
        AFTER_BASE_MODEL,
    ),
    Row(
        "the training loop, its losses, optimizer, guards and metrics; checkpoints and the export; the data "
        "order; the evaluation loop",
        (
            "src/moeflow/train/*",
            "src/moeflow/checkpoint/*",
            "src/moeflow/data/order.py",
            "src/moeflow/evaluation/loop.py",
            "src/moeflow/evaluation/__init__.py",
        ),
        AFTER_BASE_MODEL,
    ),
    Row(
        "the device and dtype a model computes in (TF32 on CUDA)",
        ("src/moeflow/model/device.py",),
        frozenset({"choose_experts", *AFTER_BASE_MODEL}),
    ),
    Row(
        "reading routers per family",
        ("src/moeflow/model/routing.py",),
        frozenset({"choose_experts", *AFTER_BASE_MODEL}),
    ),
    Row(
        "routing statistics (expert load, layer health); rows to model inputs",
        ("src/moeflow/evaluation/routing_stats.py", "src/moeflow/data/collate.py"),
        AFTER_BASE_MODEL,
    ),
    Row(
        "the shard format every stage reads or writes",
        ("src/moeflow/data/__init__.py", "src/moeflow/data/shards.py"),
        frozenset({"train_tokenizer", "tokenize", *AFTER_BASE_MODEL}),
    ),
    Row(
        "the tokenizer and the corpus sources",
        ("src/moeflow/data/tokenizer.py", "src/moeflow/data/corpus.py"),
        frozenset({"train_tokenizer", "tokenize", *AFTER_BASE_MODEL}),
    ),
    Row(
        "tokenizing a corpus, packing documents into rows",
        ("src/moeflow/data/sharding.py", "src/moeflow/data/packing.py"),
        frozenset({"tokenize", *AFTER_BASE_MODEL}),
    ),
    *(Row(f"infrastructure: {why}", (path,), frozenset()) for path, why in INFRASTRUCTURE),
)


def edited_files(root: Path = ROOT) -> list[str]:
    """Every file the rows must cover, relative to ``root``."""
    found = {p for pattern in EDITED for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}
    return sorted(p.relative_to(root).as_posix() for p in found)


def row_of(path: str) -> Row | None:
    return next((row for row in ROWS if any(fnmatch.fnmatchcase(path, p) for p in row.patterns)), None)


def in_order(rules) -> list[str]:
    return sorted(rules, key=RULE_ORDER.index)


# Named sets the table prints by name (the largest first), with their legend.
NAMED = (
    (AFTER_BASE_MODEL, "*after the base model*"),
    (AFTER_FINE_TUNING, "*after fine-tuning*"),
)
LEGEND = (
    "*after the base model*: `pretrain_base`, `coverage_valset`, `warmup` and what is after fine-tuning; "
    "*after fine-tuning*: `train_model`, the evaluation stages (`evaluate_model`, `evaluate_run`, `lm_eval_task`, "
    "`humaneval_generate`, `humaneval_execute`, `routing_drift`) and `paper`."
)


def reruns_text(rules: frozenset[str]) -> str:
    named = next(((group, name) for group, name in NAMED if group <= rules), None)
    rest = rules - named[0] if named else rules
    words = [f"`{r}`" for r in in_order(rest)] + ([named[1]] if named else [])
    return ", ".join(words) or "nothing"


def shown_path(pattern: str) -> str:
    """A row's file pattern as the table shows it: under ``src/moeflow/`` unless it would read as a top-level
    folder's (``workflow/keys.py`` is not ``src/moeflow/workflow/keys.py``)."""
    short = pattern.removeprefix("src/moeflow/")
    return pattern if (ROOT / short.split("/")[0]).exists() else short


def table() -> str:
    """The Markdown table of docs/reruns.md, with its legend."""
    lines = ["| code | files (under `src/moeflow/` unless named) | reruns (target `paper`) |", "|---|---|---|"]
    for row in ROWS:
        files = ", ".join(f"`{shown_path(p)}`" for p in row.patterns)
        lines.append(f"| {row.code} | {files} | {reruns_text(row.reruns)} |")
    return "\n".join(lines) + "\n\n" + LEGEND


def with_table(doc: str) -> str:
    """``doc`` with the text between the table's markers replaced by :func:`table`."""
    head, rest = doc.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":
    DOCS.write_text(with_table(DOCS.read_text()))
