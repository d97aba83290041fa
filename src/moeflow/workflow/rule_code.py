"""The library code that can change each rule's outputs: every rule's ``input: lib=code("<rule>")``.

Snakemake reruns a rule when one of its input files changes, but it does not see what a stage script
imports. So each rule lists the library code its outputs depend on, declared here by concern (what the
code does for that rule), not derived from the imports: a module that imports another one for a helper
does not make their stages rerun together. docs/reruns.md says what editing each part reruns.

- A name is a package (``paper``: every module under ``src/moeflow/paper``) or one module
  (``loading.factory``); a package's ``__init__`` comes with any of its modules (Python runs it first).
- ``INFRASTRUCTURE`` is no rule's input: the package root, ``runtime`` (how a stage runs: logging, atomic
  writes, provenance, GPU claims, the environment report, the torchrun job), ``settings`` (reading config sections
  into typed settings) and ``workflow`` (what only the Snakefile reads; the params it computes rerun what a setting
  changes). Infrastructure holds no computation: code that can change a number in an output lives with its
  concern and is declared here. What computing code calls of infrastructure is listed in ``PLUMBING``, each with
  the reason an edit there cannot change an output; tests/unit/test_rule_code.py refuses any other call.
- tests/unit/test_rule_code.py checks that every moeflow module a rule's script reaches through its
  imports is declared here for that rule or is infrastructure, so an import never goes silently stale;
  tests/pipeline/test_library_reruns.py edits every module of a finished pipeline and checks what reruns.

Standard library only: the Snakefile reads this at DAG build time, in Snakemake's own interpreter.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.workflow.imports import PACKAGE_DIR, module_name

# With the package root (moeflow/__init__.py): how a stage runs, not what it computes.
INFRASTRUCTURE = ("runtime", "settings", "workflow")

# Every name of infrastructure that code a stage computes with (its script and the declared modules it reaches)
# uses, with the reason an edit to it cannot change a number in any output. Reviewed: a name added here must
# hold no computation; a helper that computes moves to its concern instead (tests/unit/test_rule_code.py).
PLUMBING: dict[str, tuple[str, ...]] = {
    "the installed versions, which the stack fixes (results/<stack>, every rule's runtime param) and the "
    "environment fingerprint reruns verify_env on": (
        "runtime.compat.version_of",
        "runtime.compat.transformers_major",
        "runtime.compat.is_transformers_v5",
        "runtime.compat.require_transformers_v5",
        "runtime.compat.fsdp2_available",
        "runtime.compat.UnsupportedOnStack",
    ),
    "the job's plumbing: its params, typed (Snakemake compares the params), torch's threads set to the job's, "
    "logging, progress lines, the kill points of the fault tests": (
        "runtime.job.Job",
        "runtime.stage.Stage",
        "runtime.stage.log",
        "runtime.stage.progress",
        "runtime.stage.kill_point",
        "settings.typed",
        "settings.plain",
        "settings.enum",
        "settings.BAD_RECORD_POLICIES",
        "settings.MODEL_SCHEMA",
        "settings.PRECISIONS",
        "settings.SOURCE_SCHEMA",
    ),
    "provenance: which code and settings made an output, recorded beside its numbers": (
        "runtime.stage.code_version",
        "runtime.files.stable_hash",
    ),
    "atomic writes and reads of files whose content the caller computed": (
        "runtime.files.atomic_dir",
        "runtime.files.atomic_file",
        "runtime.files.disk_full_error",
        "runtime.files.dumps_json",
        "runtime.files.read_json",
        "runtime.files.replace_dir",
        "runtime.files.write_json",
        "runtime.files.write_text",
    ),
    "a batch copied to the device: the same values through pinned memory or not": ("runtime.host_copies.to_device",),
    "the device a model computes on, where its inputs go (hardware.device's, recorded where the parameters stay on "
    "the host under CPU offload): the same values on it": (
        "runtime.host_copies.model_device",
        "runtime.host_copies.set_compute_device",
    ),
    "figures rendered reproducibly (backend, hash salt): how a figure is drawn, no number in it": (
        "runtime.figures.pyplot",
    ),
    "the environment report and the facts of this machine (device memory for the plan's verdict, the experts "
    "implementations torch offers), which verify_env's fingerprint and the GPU checks cover": (
        "runtime.env.VerifyEnvStage",
        "runtime.env.collect",
        "runtime.env.enforce",
        "runtime.env.render_markdown",
        "runtime.env.device_memory_bytes",
        "runtime.env.experts_implementations",
        "runtime.env.torch_facts",
        "runtime.gpu_node.check",
        "runtime.gpu_node.enforce",
        "runtime.gpu_node.render_markdown",
    ),
}


# --- concerns, each the code that does one thing for the rules that list it

# Packed rows as stages read them: the Arrow shards, and rows to model inputs.
ROWS = ("data.shards", "data.collate", "families")  # a family's masks (moeflow.families.family.Family)

# The coverage validation set's format (it packs the documents it picked).
VALSET = ("data.valset", "data.packing")

# A model's transformers config and class, its typed settings, the folder checks: what reading a shape needs.
MODEL_CONFIG = ("model.configs", "families", "model.settings", "model.folder")
# Building or loading a model in every layout (the whole model, each rank's rows on meta, FSDP, expert
# parallelism, LoRA adapters over a quantized base), with the chunked loss it computes (which skips the rows'
# IGNORE_INDEX labels).
MODEL = (
    *MODEL_CONFIG,
    "loading.factory",
    "model.device",
    "model.activation_checkpointing",
    "model.chunked_loss",
    "model.wrappers",
    "model.lora",
    "model.expert_lora",
    "model.lora_merge",
    "model.adapter_layout",
    "model.quantization",
    "model.quantized_experts",
    "model.routing",  # LoRA finds the routers as the routing adapters do
    "model.parameters",
    "model.saved_names",
    "parallel",
    "model.safetensors_files",
    "train.settings",
    "data.shards",
)
# A forward-only stage's memory plan, checked before it loads its model (moeflow.plan.forward.refuse_unless_fits).
FORWARD_PLAN = ("plan.forward", "plan.activations", "plan.counts", "plan.fit", "plan.memory", "plan.shapes")
# A forward-only stage's opening: its typed settings, its layout and memory plan, its model loaded in its dtype.
FORWARD_OPENING = ("stages.forward", *FORWARD_PLAN)

# Reading the routers per family, and routing statistics over a set of rows (expert load, layer health).
ROUTING = ("model.routing", "families", "evaluation.routing_stats")

# The tokenizer and the sources it reads.
TOKENIZER = ("data.tokenizer", "data.corpus", "data.shards")

# The training loop and what it runs: the model in every layout (LoRA included), sharding and gradient
# reduction, checkpoints and the export, the rows in their order, and the evaluation loop of its evals.
TRAINING = (
    "train",
    "model",
    "families",
    "loading",
    "parallel",
    "checkpoint",
    *ROUTING,
    *ROWS,
    "data.order",
    "evaluation.loop",
)

# Loss, perplexity and per-expert tables of a model on sets of rows, with the batch loop behind them.
SET_EVALUATION = ("evaluation.run_metrics", "evaluation.loop")

# lm-evaluation-harness: the run, moeflow's corpus documents as lm-eval requests, the task resolver. The task
# YAMLs and their code (workflow/tasks) are the rule's own ``task_files`` input, per task.
LM_EVAL = ("evaluation.lm_eval_run", "evaluation.lm_eval_docs", "evaluation.lm_eval_tasks")

# HumanEval: problems, samples and pass@k.
HUMANEVAL = ("evaluation.humaneval", "evaluation.completions")

# Running HumanEval's programs in the sandbox.
SANDBOX = ("evaluation.humaneval_execution", "evaluation.sandbox", "evaluation.sandbox_launcher")


# The serving engine run in the serving environment (serve.python), and what it is asked for.
ENGINE = ("serving.engine", "serving.process")
# An export checked in the engine against moeflow's forward, and a LoRA run's adapter as the engine reads it.
SERVING_CHECK = ("serving.check", "serving.adapter", "serving.settings", *ENGINE)
# Completions generated in the engine (evaluate.humaneval.engine: vllm).
ENGINE_GENERATION = ("serving.generation", *ENGINE)
# lm-eval tasks through lm-eval's vLLM backend in the engine's environment (evaluate.lm_eval.engine: vllm).
ENGINE_HARNESS = ("serving.harness", *ENGINE)


RULES: dict[str, tuple[str, ...]] = {
    "verify_env": (),  # its script runs infrastructure only; its fingerprint param reruns it when packages change
    "choose_experts": ("model.experts_choice", "model.device", *MODEL_CONFIG, "model.routing"),
    "train_tokenizer": TOKENIZER,
    "tokenize": ("data.sharding", "data.packing", *TOKENIZER),
    "pretrain_base": TRAINING,
    "coverage_valset": ("coverage", *ROUTING, *MODEL, *ROWS, *VALSET, *FORWARD_OPENING),
    # the plan reads the model's shapes from the config the factory builds, and the typed training settings
    "plan_memory": ("plan", *MODEL_CONFIG, "model.parameters", "train.settings", "parallel.settings"),
    # ESFT: the routing totals of the fine-tuning corpus (the coverage stage's routing pass), the selection
    "esft_routing": ("train.esft", *ROUTING, *MODEL, *ROWS, *FORWARD_OPENING),
    "esft_select": ("train.esft",),
    "warmup": TRAINING,
    "train_model": (*TRAINING, *VALSET),
    "evaluate_model": (
        *SET_EVALUATION,
        *ROUTING,
        "evaluation.token_routing",
        "evaluation.drift",
        *MODEL,
        *ROWS,
        *VALSET,
        "model.parameters",
        *FORWARD_OPENING,
    ),
    "evaluate_run": ("evaluation.comparison",),  # compares evaluate_model's records
    # the set evaluation: each result carries its cross-check against moeflow's own loss
    "lm_eval_task": (*LM_EVAL, *SET_EVALUATION, *ROUTING, *MODEL, *ROWS, *FORWARD_OPENING, *ENGINE_HARNESS),
    "humaneval_generate": (*HUMANEVAL, "evaluation.generation", *ENGINE_GENERATION, *MODEL, *FORWARD_OPENING),
    "humaneval_execute": (*HUMANEVAL, *SANDBOX),
    "routing_drift": ("evaluation.drift",),  # compares evaluate_model's routings
    # the export in the serving engine (its script, moeflow.serving.engine, is part of the package) against moeflow's
    # forward of the same folder on the validation set's segments
    "serve_check": (*SERVING_CHECK, *MODEL, *ROWS, *VALSET, "model.device"),
    # a LoRA adapter split by expert module (the conversion the loader uses, without a model)
    "serving_adapter": ("serving.adapter", "serving.settings", "serving.process", *MODEL),
    "paper": ("paper",),
}


def module_files(name: str, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The source files of ``name`` (a package: all its modules, nested ones too; a module: itself) and the
    ``__init__.py`` of every package above it but the root (infrastructure)."""
    parts = name.split(".")
    base = package_dir.joinpath(*parts)
    if base.is_dir():
        files = set(base.rglob("*.py"))
    elif base.with_suffix(".py").is_file():
        files = {base.with_suffix(".py")}
    else:
        raise ValueError(f"moeflow.workflow.rule_code: {name!r} is neither a package nor a module under {package_dir}")
    return sorted(files | {package_dir.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts))})


def declared_files(rule: str, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The source files of the code declared for ``rule``."""
    if rule not in RULES:
        raise KeyError(f"moeflow.workflow.rule_code: no code is declared for rule {rule!r}; add it to RULES")
    return sorted({f for name in RULES[rule] for f in module_files(name, package_dir)})


def declared_modules(rule: str, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """The dotted moeflow modules declared for ``rule``."""
    return {module_name(f, package_dir) for f in declared_files(rule, package_dir)}


def is_infrastructure(module: str) -> bool:
    """Whether a dotted moeflow module is infrastructure (never a rule's input): the package root or a module
    of ``INFRASTRUCTURE``."""
    inside = module.split(".")[1:]
    return not inside or inside[0] in INFRASTRUCTURE


def plumbing_names() -> set[str]:
    """The dotted names of :data:`PLUMBING` (``moeflow.runtime.files.write_json``)."""
    return {f"moeflow.{name}" for names in PLUMBING.values() for name in names}


def code_files(rule: str, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """``declared_files`` as Snakemake inputs: relative to the working directory when they lie below it (an
    absolute path would change, and rerun the rule, in a moved copy)."""
    cwd = Path.cwd().resolve()
    files = [f.resolve() for f in declared_files(rule, package_dir)]
    return [str(f.relative_to(cwd)) if f.is_relative_to(cwd) else str(f) for f in files]
