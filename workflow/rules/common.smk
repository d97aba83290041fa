# Shared by all stage files: the config, the stack, the runs, result paths, each rule's settings, and the
# library code each stage lists as inputs (Snakemake does not track code imported by a script otherwise).
# Plain functions of wildcards and the config live here; workflow/rules/<stage>.smk hold the rules.
#
# Snakemake's Python imports moeflow as an installed package (`make env` installs this folder's src/ in
# editable mode; a copy of the workflow puts its own src/ on PYTHONPATH): the stage scripts, started by the
# same interpreter or by torchrun from it, import the same one.

import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake_interface_executor_plugins.settings import DeploymentMethod

try:
    import moeflow  # noqa: F401 (the package this workflow runs: installed, or this folder's src/ on PYTHONPATH)
except ModuleNotFoundError:
    raise WorkflowError(
        "moeflow: this Python cannot import moeflow: run `make env` (pip install -e .), or put this folder's src/ "
        "first on PYTHONPATH"
    ) from None
from moeflow.data.corpus import source_files
from moeflow.evaluation.lm_eval_tasks import by_label as lm_eval_task_labels
from moeflow.paper.build import paper_outputs
from moeflow.paper.eval_results import MODELS
from moeflow.parallel.launch import torchrun_command
from moeflow.plan.shapes import PlanError, model_config_fields, model_shape
from moeflow.runtime.devices import claim_command
from moeflow.runtime.env import fingerprint as environment_fingerprint
from moeflow.runtime.files import stable_hash
from moeflow.serving.settings import FUSED_IN_FILES
from moeflow.settings import REPO_ROOT, ConfigError
from moeflow.workflow import keys as stage_keys
from moeflow.workflow.load import load as load_config, resolve_stack, run_config
from moeflow.workflow.merge import run_names
from moeflow.workflow.report_card import CardFiles, RunFiles, card_stage, write_card
from moeflow.workflow.rule_code import code_files
from moeflow.workflow.rule_settings import CommandLineJson, configs_by_key, rule_settings

SRC = Path(workflow.basedir) / "src"
if REPO_ROOT.resolve() != Path(workflow.basedir).resolve():
    raise WorkflowError(
        f"moeflow: this Python imports moeflow from {REPO_ROOT / 'src'}, not from this workflow's {SRC}: "
        f"run `make env` here (pip install -e .), or put {SRC} first on PYTHONPATH"
    )

# Jobs share the cores (`--cores 8` on a laptop runs several at once): idle OpenMP threads sleep instead
# of spinning, which took a loaded step from 28-49 s to 3.4-4.3 s (benchmarks/train.py). Timing only.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    # The config again from config/config.yaml and the --configfile overlays, merged by moeflow's rules (null
    # removes a key, a source of another type is replaced, model_from_config) with the schema's defaults
    # filled in, then validated; each run's is merged and filled below.
    _loaded = load_config(*workflow.config_settings.configfiles, overrides=dict(workflow.config_settings.config))
    config.clear()
    config.update(_loaded)
    STACK = resolve_stack(config)
except ConfigError as exc:
    raise WorkflowError(f"moeflow: {exc}") from None

RESULTS = f"results/{STACK}"
# For `conda:`, which Snakemake resolves relative to the rule file (workflow/rules/), not the working directory.
ENV_FILE = f"../../envs/{STACK}.yaml"
RUNS = {name: run_config(config, name) for name in run_names(config)}
if not RUNS:
    raise WorkflowError("moeflow: the config defines no runs (config key 'runs'); add at least one, e.g. runs: {moe: {}}")

# Data stages are keyed by their own settings, so runs that agree on data share them.
TOKENIZERS = {stage_keys.tokenizer_key(cfg): stage_keys.tokenizer_settings(cfg) for cfg in RUNS.values()}
DATASETS = {stage_keys.data_key(cfg): stage_keys.data_settings(cfg) for cfg in RUNS.values()}


def code(rule):
    """The library code that can change ``rule``'s outputs, declared by concern in moeflow.workflow.rule_code, as
    the rule's ``lib`` input: editing one of those files reruns the rule (docs/reruns.md)."""
    return code_files(rule, SRC / "moeflow")


def runtime(cfg=config, torch=True):
    """Stack, precision and seed of the config ``cfg`` (a run's, or the whole config's), and for a rule that
    computes with torch (``torch``) its threads, which split torch's reductions: recorded in every output, and
    part of every rule's params, so a change reruns it."""
    return {"stack": STACK, "precision": cfg["precision"], "seed": cfg["seed"]} | ({"threads": config["threads"]} if torch else {})


def log_path(rule, *parts):
    return f"{RESULTS}/logs/{rule}/{'/'.join(parts) or rule}.log"


def bench_path(rule, *parts):
    return f"{RESULTS}/benchmarks/{rule}/{'/'.join(parts) or rule}.tsv"


# --- the run config a job serves: its run's ({run}), or the one behind the key that names its output


def coverage_source(cfg):
    """The run config whose coverage validation set ``cfg`` uses: its own, or that of the run named by
    ``coverage.valset_of_run`` (a model without experts, such as the dense comparison run, cannot route one)."""
    other = cfg["coverage"]["valset_of_run"]
    if not other:
        return cfg
    if other not in RUNS or RUNS[other]["coverage"]["valset_of_run"]:
        raise WorkflowError(f"moeflow: config key 'coverage.valset_of_run': {other!r} must name a run with its own validation set ({', '.join(RUNS)})")
    return RUNS[other]


def is_esft(cfg):
    return cfg["train"]["method"] == "esft"


try:
    # Key -> the run config it serves; two runs with one key must agree on what its stage reads.
    KEYED = {
        "basekey": configs_by_key("basekey", {run: cfg for run, cfg in RUNS.items() if not cfg["model"]["pretrained"]}),
        "covkey": configs_by_key("covkey", {run: coverage_source(cfg) for run, cfg in RUNS.items()}),
        "warmkey": configs_by_key("warmkey", RUNS),
        "routkey": configs_by_key("routkey", {run: cfg for run, cfg in RUNS.items() if is_esft(cfg)}),
        "selkey": configs_by_key("selkey", {run: cfg for run, cfg in RUNS.items() if is_esft(cfg)}),
    }
except ConfigError as exc:
    raise WorkflowError(f"moeflow: {exc}") from None


def config_of(wildcards):
    """The run config a job serves: its run's for a ``{run}`` job, else the config behind its key wildcard."""
    named = dict(wildcards.items())
    if "run" in named:
        return RUNS[named["run"]]
    return next(KEYED[name][key] for name, key in named.items() if name in KEYED)


# --- paths shared between stages


def tokenizer_dir(settings):
    """The tokenizer folder for a set of tokenizer settings: the pretrained model's, or one trained here."""
    return settings["pretrained_model"] or f"{RESULTS}/tokenizer/t-{stable_hash(settings)}"


def corpus_files(wildcards):
    """Source files of a corpus, so that editing one reruns the stage (stdlib is recorded in the manifest)."""
    return source_files(DATASETS[wildcards.datakey]["data"]["sources"][wildcards.corpus])


def data_dir(cfg, corpus):
    return f"{RESULTS}/data/{stage_keys.data_key(cfg)}/{corpus}"


def base_model_dir(cfg):
    return cfg["model"]["pretrained"] or f"{RESULTS}/base/{stage_keys.base_key(cfg)}"


def coverage_dir(cfg):
    return f"{RESULTS}/coverage/{stage_keys.coverage_key(coverage_source(cfg))}"


# --- the experts implementation (rule choose_experts)

EXPERTS = {stage_keys.experts_key(cfg, part): stage_keys.experts_settings(cfg, part) for cfg in RUNS.values() for part in stage_keys.EXPERTS_PARTS}


def experts_choice(cfg, part="train"):
    """The experts choice (moeflow.model.experts_choice), input ``experts`` of every job that loads ``cfg``'s model,
    timed at a micro-batch of ``part`` (train for fine-tuning and evaluation, pretrain for the base model's stages)."""
    return f"{RESULTS}/experts/{stage_keys.experts_key(cfg, part)}/choice.json"


def experts_timings(cfg, part="train"):
    """The timings behind :func:`experts_choice` (reports only: never an input of a rule that trains)."""
    return f"{RESULTS}/experts/{stage_keys.experts_key(cfg, part)}/timings.json"


def run_targets(cfg, run):
    """Everything a run needs before fine-tuning starts."""
    return [
        f"{RESULTS}/runs/{run}/plan.json",
        f"{coverage_dir(cfg)}/coverage.json",
    ] + [data_dir(cfg, c) for c in [cfg["data"]["finetune_corpus"], *cfg["data"]["eval_corpora"]]]


# --- a job's inputs, as functions of its wildcards


def base_model(wildcards):
    return base_model_dir(config_of(wildcards))


def base_tokenizer(wildcards):
    return tokenizer_dir(stage_keys.tokenizer_settings(config_of(wildcards)))


def base_corpus_data(wildcards):
    cfg = config_of(wildcards)
    return data_dir(cfg, cfg["data"]["base_corpus"])


def finetune_data(wildcards):
    cfg = config_of(wildcards)
    return data_dir(cfg, cfg["data"]["finetune_corpus"])


def eval_data(wildcards):
    cfg = config_of(wildcards)
    return [data_dir(cfg, c) for c in cfg["data"]["eval_corpora"]]


def pool_data(wildcards):
    cfg = config_of(wildcards)
    return [data_dir(cfg, c) for c in cfg["coverage"]["pool_corpora"]]


def experts(wildcards):
    """The experts choice of a job that loads the run's model after fine-tuning starts (fine-tuning, evaluation)."""
    return experts_choice(config_of(wildcards))


def pretrain_experts(wildcards):
    """The experts choice of a job that loads the base model as pretraining holds it (pretrain_base, coverage_valset)."""
    return experts_choice(config_of(wildcards), "pretrain")


def valset(wildcards):
    return f"{coverage_dir(config_of(wildcards))}/valset"


def warmup_checkpoint(wildcards):
    return warmup_dir(config_of(wildcards))


def expert_selection(wildcards):
    """ESFT's expert selection (esft_select's output) for the training stages; none for other methods."""
    return esft_selection(config_of(wildcards))


def routing_totals(wildcards):
    return esft_totals(config_of(wildcards))


def finetuned_model(wildcards):
    return final_model_dir(wildcards.run)


def memory_plan(wildcards):
    return f"{RESULTS}/runs/{wildcards.run}/plan.json"


def evaluated_model_dir(wildcards):
    """The folder of the model a per-model evaluation job reads: the run's base ({model} = base) or its fine-tuned model."""
    return base_model(wildcards) if wildcards.model == "base" else finetuned_model(wildcards)


def model_config_file(wildcards):
    """The pretrained folder's config.json that choose_experts reads (none for a model built from config)."""
    return [f"{p}/config.json" for p in [EXPERTS[wildcards.expkey]["model"]["pretrained"]] if p]


# --- a job's params: its settings and runtime (Snakemake compares both), as functions of its wildcards

# The rules whose scripts never compute with torch: their runtime leaves torch's threads out.
WITHOUT_TORCH = (
    "verify_env",
    "train_tokenizer",
    "tokenize",
    "plan_memory",
    "esft_select",
    "evaluate_run",
    "routing_drift",
    "humaneval_execute",
    "serving_adapter",
    "paper",
)


def settings(rule):
    """``params.settings`` of ``rule``: moeflow.workflow.rule_settings's settings of the config its job serves."""

    def of(wildcards):
        cfg = config_of(wildcards)
        return CommandLineJson(rule_settings(rule, cfg, dict(wildcards.items()), coverage_source(cfg)))

    return of


def job_runtime(rule):
    """``params.runtime`` of ``rule`` (:func:`runtime`) for the config its job serves. coverage_valset's is the
    whole config's: its key holds no precision, so every run that shares the set shares how it was routed."""

    def of(wildcards):
        cfg = config if rule == "coverage_valset" else config_of(wildcards)
        return CommandLineJson(runtime(cfg, torch=rule not in WITHOUT_TORCH))

    return of


def tokenizer_settings(wildcards):
    return TOKENIZERS[wildcards.tokkey]


def data_settings(wildcards):
    return DATASETS[wildcards.datakey]


def experts_settings(wildcards):
    return EXPERTS[wildcards.expkey]


def experts_gpus(wildcards):
    """choose_experts times one MoE block on one GPU with hardware.device cuda."""
    return 1 if EXPERTS[wildcards.expkey]["device"] == "cuda" else 0


def data_tokenizer(wildcards):
    return tokenizer_dir(DATASETS[wildcards.datakey]["tokenizer"])


# --- evaluation and paper

PAPER = f"{RESULTS}/paper"


def run_eval_dir(run):
    return f"{RESULTS}/runs/{run}/eval"


def is_moe_run(run):
    """Whether the run's model has MoE layers (from its config, or its pretrained folder's config.json)."""
    try:
        return bool(model_shape(model_config_fields(RUNS[run]["model"]), 1).moe_layers)
    except PlanError as exc:
        raise WorkflowError(f"moeflow: run {run!r}: {exc}") from None


class JobWildcards(dict):
    """A job's wildcards where no job is running yet, read as Snakemake's (``wildcards.run``)."""

    __getattr__ = dict.__getitem__


# The inputs of a base-model evaluation job beside its settings and runtime, by rule (as the rules list them).
BASE_EVALUATION_INPUTS = {
    "evaluate_model": lambda wc: [base_model(wc), experts(wc), valset(wc), eval_data(wc)],
    "lm_eval_task": lambda wc: [base_model(wc), experts(wc), task_files(wc), task_data(wc)],
    "humaneval": lambda wc: [base_model(wc), experts(wc)],
}
BASE_EVALUATION_RULES = {"evaluate_model": ("evaluate_model",), "lm_eval_task": ("lm_eval_task",), "humaneval": ("humaneval_generate", "humaneval_execute")}


def base_evaluation(kind, run, **wildcards):
    """What a job scoring ``run``'s base model reads and computes with (``kind``: evaluate_model, lm_eval_task,
    humaneval: its generation and execution): its inputs, settings and runtime, as Snakemake compares them."""
    wc = JobWildcards(run=run, model="base", **wildcards)
    compared = [(str(settings(rule)(wc)), str(job_runtime(rule)(wc))) for rule in BASE_EVALUATION_RULES[kind]]
    return repr((BASE_EVALUATION_INPUTS[kind](wc), compared))


def base_evaluation_run(kind, run, **wildcards):
    """The run whose job scores ``run``'s base model for ``kind``: the first run, in config order, whose job would
    read the same files with the same settings. Runs that fine-tune one base model and evaluate it alike share one
    job (its result in that run's folder), so a paper scores each base once."""
    task = wildcards.get("task")
    has = [r for r in RUNS if task is None or task in lm_eval_task_labels(RUNS[r]["evaluate"]["tasks"])]
    if kind == "humaneval":
        has = [r for r in has if RUNS[r]["evaluate"]["humaneval"]["enabled"]]
    mine = base_evaluation(kind, run, **wildcards)
    return next(r for r in has if base_evaluation(kind, r, **wildcards) == mine)


# Rule evaluate_model's outputs beside each other, by output name: the record and the routing kept for routing_drift.
EVALUATE_MODEL_ENDINGS = {"json": ".json", "routing": ".routing.safetensors"}


def evaluate_model_file(run, model, output="json"):
    """Rule evaluate_model's ``output`` (EVALUATE_MODEL_ENDINGS) for ``run``'s ``model`` (base or finetuned), the base
    model's from the run that scores it (:func:`base_evaluation_run`)."""
    scored_by = base_evaluation_run("evaluate_model", run) if model == "base" else run
    return f"{run_eval_dir(scored_by)}/sets/{model}{EVALUATE_MODEL_ENDINGS[output]}"


def evaluated(model, output):
    """Input ``model`` (base or finetuned) of a run's evaluate_run (``output`` json) or routing_drift job (routing):
    :func:`evaluate_model_file`."""

    def of(wildcards):
        return evaluate_model_file(wildcards.run, model, output)

    return of


def lm_eval_files(run):
    """The lm_eval_task rule's results of a run, task label -> model -> path: each of evaluate.tasks on both models,
    the base model's from the run that scores it (:func:`base_evaluation_run`)."""
    files = {}
    for task in lm_eval_task_labels(RUNS[run]["evaluate"]["tasks"]):
        scored_by = {"base": base_evaluation_run("lm_eval_task", run, task=task), "finetuned": run}
        files[task] = {model: f"{run_eval_dir(scored_by[model])}/lm_eval/{model}/{task}.json" for model in MODELS}
    return files


def lm_eval_task_of(wildcards):
    """An lm_eval_task job's task (wildcards run and task), resolved from the run's evaluate.tasks."""
    return lm_eval_task_labels(RUNS[wildcards.run]["evaluate"]["tasks"])[wildcards.task]


def task_files(wildcards):
    """The task's YAML and code, relative to the working directory: an absolute path would change (and rerun
    the task) in a moved copy."""
    return [os.path.relpath(p) for p in lm_eval_task_of(wildcards).files]


def task_data(wildcards):
    """The run's evaluation corpora if an lm_eval_task job's task reads their test splits (moeflow's own tasks)."""
    return eval_data(wildcards) if lm_eval_task_of(wildcards).docs else []


def humaneval_files(run):
    """The humaneval execution rule's results of a run, model -> path; none when evaluate.humaneval is off."""
    if not RUNS[run]["evaluate"]["humaneval"]["enabled"]:
        return {}
    scored_by = {"base": base_evaluation_run("humaneval", run), "finetuned": run}
    return {model: f"{run_eval_dir(scored_by[model])}/humaneval/{model}/results.json" for model in MODELS}


def drift_file(run):
    """The routing_drift rule's drift.json of an MoE run; None for a dense run (it has no router)."""
    return f"{run_eval_dir(run)}/drift.json" if is_moe_run(run) else None


def serving_adapter_dir(run):
    """The serving_adapter rule's output for a LoRA run of an MoE model whose router is not fully trained (a trainable
    router is no adapter a serving engine applies) and whose files hold one module per expert
    (moeflow.serving.settings.FUSED_IN_FILES); None for any other run."""
    train = RUNS[run]["train"]
    if train["method"] != "lora" or train["lora"]["router"] == "trainable" or not is_moe_run(run):
        return None
    if model_config_fields(RUNS[run]["model"]).get("model_type") in FUSED_IN_FILES:
        return None
    return f"{RESULTS}/runs/{run}/serve/adapter"


def serve_check_inputs(wildcards):
    """serve_check's inputs: the run's exported model, its base model folder, the experts choice, the validation set,
    and a LoRA run's serving adapter."""
    inputs = {"model": finetuned_model(wildcards), "base": base_model(wildcards), "experts": experts(wildcards)}
    inputs["valset"] = valset(wildcards)
    adapter = serving_adapter_dir(wildcards.run)
    return inputs | ({"adapter": adapter} if adapter else {})


def serve_check_file(run):
    """The serve_check rule's record of a run; None where its serve.python is null (no serving environment)."""
    return f"{RESULTS}/runs/{run}/serve/check.json" if RUNS[run]["serve"]["python"] else None


def serve_check_files(wildcards=None):
    """Every run's serving check (the paper's and the serve target's inputs): none where serve.python is null."""
    return [path for path in map(serve_check_file, RUNS) if path]


def model_stage_results(wildcards=None):
    """Every run's results of the evaluation stages that run a model, the on_device target's inputs: its lm-eval
    tasks, HumanEval's samples (not their execution) and the routing drift."""
    lm_eval = [path for run in RUNS for by_model in lm_eval_files(run).values() for path in by_model.values()]
    samples = [path.replace("results.json", "samples.jsonl") for run in RUNS for path in humaneval_files(run).values()]
    return list(dict.fromkeys(lm_eval + samples + [drift for drift in map(drift_file, RUNS) if drift]))


def eval_result_files(wildcards=None):
    """Every run's lm-eval, HumanEval and routing-drift results, as moeflow.paper.eval_results.read_run_results
    takes them (the paper rule's params; ``eval_result_paths`` lists the same files as its inputs)."""
    return {run: {"lm_eval": lm_eval_files(run), "humaneval": humaneval_files(run), "drift": drift_file(run)} for run in RUNS}


def eval_result_paths(wildcards=None):
    """The files of ``eval_result_files`` as one list (the paper rule's inputs)."""
    paths = []
    for files in eval_result_files().values():
        paths += [path for by_model in files["lm_eval"].values() for path in by_model.values()]
        paths += [*files["humaneval"].values(), *([files["drift"]] if files["drift"] else [])]
    return list(dict.fromkeys(paths))  # runs that share a base model share its results


def paper_corpora():
    """Each run's general and target slice (data.base_corpus, data.finetune_corpus) for the forgetting table."""
    return {run: {"general": cfg["data"]["base_corpus"], "target": cfg["data"]["finetune_corpus"]} for run, cfg in RUNS.items()}


def paper_data():
    """The tokenized corpora behind every run's numbers, by 'datakey/corpus' (fingerprinted in the paper's provenance)."""
    out = {}
    for cfg in RUNS.values():
        data = cfg["data"]
        for corpus in {data["base_corpus"], data["finetune_corpus"], *data["eval_corpora"], *coverage_source(cfg)["coverage"]["pool_corpora"]}:
            out[f"{stage_keys.data_key(cfg)}/{corpus}"] = data_dir(cfg, corpus)
    return dict(sorted(out.items()))


def paper_output_files():
    """The paper rule's outputs by name; PNG figures and CSV tables go into the HTML report, with the
    caption workflow/report/paper_<name>.rst."""
    categories = {"figures": "Paper figures", "tables": "Paper tables"}
    return {
        key: report(path, caption=f"../report/paper_{Path(path).stem}.rst", category=categories[Path(path).parent.name])
        if path.endswith((".png", ".csv"))
        else path
        for key, path in paper_outputs(PAPER).items()
    }


def paper_outdir(wildcards, output):
    return os.path.dirname(output.provenance)


# --- stages that run through torchrun (pretrain_base, warmup, train_model and the six forward-only stages): shell
# rules that start their script through torchrun; the script reads its job, and its typed settings, with
# moeflow.runtime.job.Job.from_argv.


def gpus_of(cfg, ranks=1):
    """``resources.gpu`` of a job that runs ``ranks`` ranks of the run config ``cfg``: one GPU each with
    hardware.device cuda, none on the CPU. Snakemake's ``--resources gpu=N`` then runs no more GPU jobs at once
    than the machine has GPUs, and each job claims its own (moeflow.runtime.devices). A SLURM profile's
    set-resources replaces it per rule (profiles/slurm)."""
    return ranks if cfg["hardware"]["device"] == "cuda" else 0


TRAINING_RULES = ("warmup", "train_model")


def ranks_per_node(rule, cfg):
    """The ranks per node of a job of ``rule``: parallel.nproc_per_node for training; a forward-only stage's
    section's ``ranks`` (evaluate.ranks, coverage.ranks: moeflow.workflow.keys.FORWARD_STAGE_SECTIONS); one for
    pretrain_base (the base model does not depend on parallel)."""
    section = stage_keys.FORWARD_STAGE_SECTIONS.get(rule)
    if section:
        return cfg[section]["ranks"]
    return cfg["parallel"]["nproc_per_node"] if rule in TRAINING_RULES else 1


def job_gpus(rule):
    """``resources.gpu`` of ``rule``'s job: one GPU per rank, on each of parallel.nnodes for training."""

    def gpus(wildcards):
        cfg = config_of(wildcards)
        return gpus_of(cfg, ranks_per_node(rule, cfg) * (training_nodes(wildcards) if rule in TRAINING_RULES else 1))

    return gpus


def training_nodes(wildcards):
    """``resources.nodes`` of a training job: parallel.nnodes."""
    return config_of(wildcards)["parallel"]["nnodes"]


def training_python():
    """The job's Python: the rule's conda env with --sdm conda, else Snakemake's own."""
    return "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable


def torchrun_launcher(rule):
    """``params.launcher`` of ``rule``, from moeflow.parallel.launch.torchrun_command (at one rank on one node the
    interpreter alone). One rank per GPU of the job's ``resources.gpu`` over ``resources.nodes`` (set per rule in
    a SLURM profile; on several nodes, each node's torchrun gets the rule's threads); without that resource,
    :func:`ranks_per_node` ranks (GPUs with hardware.device cuda, gloo CPU ranks with cpu); pretrain_base without
    it, one CPU rank. The script checks that the ranks it finds are what its settings ask for."""

    def launcher(wildcards, resources, threads):
        gpus = int(getattr(resources, "gpu", 0) or 0)
        if gpus:
            nodes = int(getattr(resources, "nodes", 1) or 1)
            command = torchrun_command(training_python(), gpus=gpus, nodes=nodes, threads=threads)
            # on one node, the job's own GPUs first (moeflow.runtime.devices); several nodes are SLURM's
            return (claim_command(training_python(), gpus, f"rule {rule}") if nodes == 1 else "") + command
        cfg = config_of(wildcards)
        on_gpus = cfg["hardware"]["device"] == "cuda" and rule != "pretrain_base"
        if on_gpus:
            return torchrun_command(training_python(), gpus=ranks_per_node(rule, cfg))
        return torchrun_command(training_python(), cpu_ranks=ranks_per_node(rule, cfg))

    return launcher


def torchrun_params(rule, **paths):
    """A torchrun rule's params: ``settings`` and ``runtime``, which Snakemake compares (a change reruns the rule)
    and the script reads from its command line as JSON; ``job``, the rule's name and its input, output and other
    paths (``paths``: values or functions of wildcards), built from input and output, so Snakemake's params
    trigger skips it, which is right for paths; and ``launcher``."""

    def job(wildcards, input, output):
        named = {name: value(wildcards) if callable(value) else value for name, value in paths.items()}
        return CommandLineJson(rule=rule, input=dict(input.items()), output=dict(output.items()), params=named)

    return {"settings": settings(rule), "runtime": job_runtime(rule), "job": job, "launcher": torchrun_launcher(rule)}


TORCHRUN_SHELL = (
    "{params.launcher} {input.script:q} --job {params.job:q} --settings {params.settings:q}"
    " --runtime {params.runtime:q} --threads {threads} --log-file {log:q}"
)


def esft_totals(cfg):
    return f"{RESULTS}/esft/routing/{stage_keys.esft_routing_key(cfg)}/totals.json"


def esft_selection(cfg):
    """The expert selection (esft_select's output) the training stages of ``cfg`` take; none for other methods."""
    if not is_esft(cfg):
        return []
    return f"{RESULTS}/esft/selection/{stage_keys.esft_selection_key(cfg)}/selection.json"


CHECKPOINTS = f"{RESULTS}/checkpoints"  # resumable checkpoints, outside every declared output


def warmup_dir(cfg):
    return f"{RESULTS}/warmup/{stage_keys.warmup_key(cfg)}"


def warmup_report(wildcards):
    """Where a warmup whose routing gate failed writes its report (a log, never an output)."""
    return f"{RESULTS}/logs/warmup/{wildcards.warmkey}.routing_report.json"


def final_model_dir(run):
    """The fine-tuned model of a run: a folder AutoModelForCausalLM/AutoTokenizer.from_pretrained load."""
    return f"{RESULTS}/runs/{run}/model"


def train_logs_dir(run):
    """TensorBoard event files, metrics.jsonl and summary.json of a run's fine-tuning (warmup included)."""
    return f"{RESULTS}/runs/{run}/train"


# --- the report card (moeflow.workflow.report_card): printed by the Snakefile's onsuccess, kept in RESULTS

REPORT_CARD = f"{RESULTS}/report_card.md"


def report_card_files(stage):
    """Every run's output paths for the card of ``stage`` (train or paper): the rules' own paths, above."""
    evaluated = stage == "paper"
    runs = [
        RunFiles(
            run=run,
            moe=is_moe_run(run),
            plan=f"{RESULTS}/runs/{run}/plan.json",
            warmup=warmup_dir(cfg),
            model=final_model_dir(run),
            train_logs=train_logs_dir(run),
            train_log=log_path("train_model", run),
            train_benchmark=bench_path("train_model", run),
            evaluation=f"{run_eval_dir(run)}/metrics.json" if evaluated else None,
            lm_eval=lm_eval_files(run) if evaluated else {},
            humaneval=humaneval_files(run) if evaluated else {},
            drift=drift_file(run) if evaluated else None,
            serve=serve_check_file(run) if evaluated else None,
        )
        for run, cfg in RUNS.items()
    ]
    twin = config["paper"]["noise_run"]
    noise = (config["paper"]["moe_run"], twin) if evaluated and twin else None
    return CardFiles(stack=STACK, stage=stage, runs=runs, logs=f"{RESULTS}/logs", paper=PAPER if evaluated else None, noise=noise)


def print_report_card():
    """After a finished ``train`` or ``paper`` (or no target: train), the card of every run, logged and written
    to REPORT_CARD. Snakemake calls no onsuccess after a dry run or a run with nothing to be done."""
    settings = workflow.dag_settings
    stage = card_stage(settings.targets, workflow.default_target)
    if stage is None or settings.until or settings.omit_from:
        return
    try:
        card = write_card(report_card_files(stage), REPORT_CARD)
    except Exception as exc:  # the run's outputs are complete: an unreadable file costs the card, not the run
        logger.warning(f"moeflow: no report card ({type(exc).__name__}: {exc}); the outputs are under {RESULTS}")
        return
    logger.info(card + f"(kept in {REPORT_CARD})")
