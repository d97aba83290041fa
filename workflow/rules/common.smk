# Shared by all stage files: config validation, the stack, the runs, result paths, and the library
# code each stage lists as inputs (Snakemake does not track code imported by a script otherwise).
# Functions live here only; workflow/rules/<stage>.smk hold rules only.

import json
import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

SRC = Path(workflow.basedir) / "src"
sys.path.insert(0, str(SRC))
# Stage scripts run in their own interpreter (the rule's conda env, or Snakemake's own Python):
# they find the moeflow package through PYTHONPATH.
os.environ.update(
    PYTHONPATH=os.pathsep.join([str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
)

# Jobs share the cores (`--cores 8` on a laptop runs several at once): idle OpenMP threads sleep instead
# of spinning, which took a loaded step from 28-49 s to 3.4-4.3 s (benchmarks/train.py). Timing only.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from moeflow.settings import ConfigError
from moeflow.workflow import keys as stage_keys
from moeflow.workflow.load import load as load_config, resolve_stack, run_config
from moeflow.workflow.merge import run_names
from moeflow.runtime.env import fingerprint as environment_fingerprint
from moeflow.workflow.rule_code import code_files

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


def runtime(run=None, torch=True):
    """Stack, precision and seed, and for a rule that computes with torch (``torch``) its threads, which split
    torch's reductions: recorded in every output, and part of every rule's params, so a change reruns it."""
    cfg = RUNS[run] if run else config
    return {"stack": STACK, "precision": cfg["precision"], "seed": cfg["seed"]} | ({"threads": config["threads"]} if torch else {})


def log_path(rule, *parts):
    return f"{RESULTS}/logs/{rule}/{'/'.join(parts) or rule}.log"


def bench_path(rule, *parts):
    return f"{RESULTS}/benchmarks/{rule}/{'/'.join(parts) or rule}.tsv"


# --- paths shared between stages


def tokenizer_dir(settings):
    """The tokenizer folder for a set of tokenizer settings: the pretrained model's, or one trained here."""
    return settings["pretrained_model"] or f"{RESULTS}/tokenizer/t-{stage_keys.stable_hash(settings)}"


def corpus_files(wc):
    """Source files of a corpus, so that editing one reruns the stage (stdlib is recorded in the manifest)."""
    from moeflow.data.corpus import source_files

    return source_files(DATASETS[wc.datakey]["data"]["sources"][wc.corpus])


def data_dir(cfg, corpus):
    return f"{RESULTS}/data/{stage_keys.data_key(cfg)}/{corpus}"


BASES = {stage_keys.base_key(cfg): cfg for cfg in RUNS.values() if not cfg["model"]["pretrained"]}


def base_model_dir(cfg):
    return cfg["model"]["pretrained"] or f"{RESULTS}/base/{stage_keys.base_key(cfg)}"


def coverage_source(cfg):
    """The run config whose coverage validation set ``cfg`` uses: its own, or that of the run named by
    ``coverage.valset_of_run`` (a model without experts, such as the dense comparison run, cannot route one)."""
    other = cfg["coverage"]["valset_of_run"]
    if not other:
        return cfg
    if other not in RUNS or RUNS[other]["coverage"]["valset_of_run"]:
        raise WorkflowError(f"moeflow: config key 'coverage.valset_of_run': {other!r} must name a run with its own validation set ({', '.join(RUNS)})")
    return RUNS[other]


COVERAGES = {stage_keys.coverage_key(coverage_source(cfg)): coverage_source(cfg) for cfg in RUNS.values()}


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


# --- evaluation and paper

from moeflow.paper.build import paper_outputs
from moeflow.paper.eval_results import MODELS
from moeflow.evaluation.lm_eval_tasks import by_label as lm_eval_task_labels
from moeflow.plan.shapes import PlanError, model_config_fields, model_shape

PAPER = f"{RESULTS}/paper"


def evaluated_model_dir(wildcards):
    """The folder of the model a per-model evaluation job reads: the run's base ({model} = base) or its fine-tuned model."""
    return base_model_dir(RUNS[wildcards.run]) if wildcards.model == "base" else final_model_dir(wildcards.run)


def run_eval_dir(run):
    return f"{RESULTS}/runs/{run}/eval"


def is_moe_run(run):
    """Whether the run's model has MoE layers (from its config, or its pretrained folder's config.json)."""
    try:
        return bool(model_shape(model_config_fields(RUNS[run]["model"]), 1).moe_layers)
    except PlanError as exc:
        raise WorkflowError(f"moeflow: run {run!r}: {exc}") from None


def lm_eval_files(run):
    """The lm_eval_task rule's results of a run, task label -> model -> path: each of evaluate.tasks on both models."""
    return {
        task: {model: f"{run_eval_dir(run)}/lm_eval/{model}/{task}.json" for model in MODELS}
        for task in lm_eval_task_labels(RUNS[run]["evaluate"]["tasks"])
    }


def lm_eval_task_of(wc):
    """An lm_eval_task job's task (wildcards run and task), resolved from the run's evaluate.tasks."""
    return lm_eval_task_labels(RUNS[wc.run]["evaluate"]["tasks"])[wc.task]


def task_corpora(wc):
    """The run's evaluation corpora if an lm_eval_task job's task reads their test splits (moeflow's own tasks)."""
    return RUNS[wc.run]["data"]["eval_corpora"] if lm_eval_task_of(wc).docs else []


def humaneval_files(run):
    """The humaneval execution rule's results of a run, model -> path; none when evaluate.humaneval is off."""
    if not RUNS[run]["evaluate"]["humaneval"]["enabled"]:
        return {}
    return {model: f"{run_eval_dir(run)}/humaneval/{model}/results.json" for model in MODELS}


def drift_file(run):
    """The routing_drift rule's drift.json of an MoE run; None for a dense run (it has no router)."""
    return f"{run_eval_dir(run)}/drift.json" if is_moe_run(run) else None


def model_stage_results():
    """Every run's results of the evaluation stages that run a model, the on_device target's inputs: its lm-eval
    tasks, HumanEval's samples (not their execution) and the routing drift."""
    lm_eval = [path for run in RUNS for by_model in lm_eval_files(run).values() for path in by_model.values()]
    samples = [f"{run_eval_dir(run)}/humaneval/{model}/samples.jsonl" for run in RUNS for model in humaneval_files(run)]
    return lm_eval + samples + [drift for drift in map(drift_file, RUNS) if drift]


def eval_result_files():
    """Every run's lm-eval, HumanEval and routing-drift results, as moeflow.paper.eval_results.read_run_results
    takes them (the paper rule's params; ``eval_result_paths`` lists the same files as its inputs)."""
    return {run: {"lm_eval": lm_eval_files(run), "humaneval": humaneval_files(run), "drift": drift_file(run)} for run in RUNS}


def eval_result_paths(wildcards=None):
    """The files of ``eval_result_files`` as one list (the paper rule's inputs)."""
    paths = []
    for files in eval_result_files().values():
        paths += [path for by_model in files["lm_eval"].values() for path in by_model.values()]
        paths += [*files["humaneval"].values(), *([files["drift"]] if files["drift"] else [])]
    return paths


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


# --- training stages (pretrain_base, warmup, train_model): shell rules that start their script
# through torchrun; the script reads its job, and its typed settings, with moeflow.runtime.job.Job.from_argv.


def gpus_of(cfg, ranks=1):
    """``resources.gpu`` of a job that runs ``ranks`` ranks of the run config ``cfg``: one GPU each with
    hardware.device cuda, none on the CPU. Snakemake's ``--resources gpu=N`` then runs no more GPU jobs at once
    than the machine has GPUs, and each job claims its own (moeflow.runtime.devices). A SLURM profile's
    set-resources replaces it per rule (profiles/slurm)."""
    return ranks if cfg["hardware"]["device"] == "cuda" else 0


def training_gpus(cfg):
    """The GPUs of a training job of ``cfg`` (warmup, train_model): parallel.nproc_per_node on each of parallel.nnodes."""
    return gpus_of(cfg, cfg["parallel"]["nproc_per_node"] * cfg["parallel"]["nnodes"])


def forward_gpus(cfg, ranks=1):
    """The GPUs of a forward-only job of ``cfg`` on ``ranks`` ranks (evaluate_run, lm_eval_task, humaneval_generate
    and routing_drift: evaluate.ranks; coverage_valset: coverage.ranks; choose_experts loads the whole model on one
    device)."""
    return gpus_of(cfg, ranks)


def training_python():
    """The job's Python: the rule's conda env with --sdm conda, else Snakemake's own."""
    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    return "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable


def torchrun_launcher(rule, cfg_of=None, ranks_of=lambda cfg: cfg["parallel"]["nproc_per_node"]):
    """``params.launcher`` of the torchrun rules, from moeflow.parallel.launch.torchrun_command (at one rank on one
    node the interpreter alone). One rank per GPU
    of the job's ``resources.gpu`` over ``resources.nodes`` (set per rule in a SLURM profile; on several nodes,
    each node's torchrun gets the rule's threads); without
    that resource, ``ranks_of(cfg)`` ranks (default parallel.nproc_per_node) of the run config ``cfg_of(wildcards)`` (GPUs with
    hardware.device cuda, gloo CPU ranks with cpu), or one rank without ``cfg_of``. The script checks
    that the ranks it finds are what the config's parallel section asks for."""
    from moeflow.parallel.launch import torchrun_command
    from moeflow.runtime.devices import claim_command

    def launcher(wildcards, resources, threads):
        cfg = cfg_of(wildcards) if cfg_of else None
        per_node = ranks_of(cfg) if cfg else 1
        gpus = int(getattr(resources, "gpu", 0) or 0)
        if gpus:
            nodes = int(getattr(resources, "nodes", 1) or 1)
            command = torchrun_command(training_python(), gpus=gpus, nodes=nodes, threads=threads)
            # on one node, the job's own GPUs first (moeflow.runtime.devices); several nodes are SLURM's
            return (claim_command(training_python(), gpus, f"rule {rule}") if nodes == 1 else "") + command
        if cfg is not None and cfg["hardware"]["device"] == "cuda":
            return torchrun_command(training_python(), gpus=per_node)
        return torchrun_command(training_python(), cpu_ranks=per_node)

    return launcher


TRAIN_SHELL = "{params.launcher} {input.script:q} --job {params.job:q} --threads {threads} --log-file {log:q}"


def torchrun_job(rule, **params):
    """The script's job description (``moeflow.runtime.job.Job.from_argv``): rule, inputs, outputs, params.
    Params are whole settings dicts, so Snakemake reruns the rule when one changes."""

    def job(wildcards, input, output):
        values = {k: (v(wildcards) if callable(v) else v) for k, v in params.items()}
        return json.dumps({"rule": rule, "input": dict(input.items()), "output": dict(output.items()), "params": values}, sort_keys=True)

    return job


def torchrun_params(rule, **params):
    """A torchrun rule's params: ``job``, the script's job description (:func:`torchrun_job`), and ``compared``,
    the same settings built from the wildcards only, which rerun the rule when they change (Snakemake's params
    trigger skips params derived from input or output, as the job description is)."""
    compared = lambda wildcards: {k: (v(wildcards) if callable(v) else v) for k, v in params.items()}
    return {"job": torchrun_job(rule, **params), "compared": compared}


WARMUPS = {stage_keys.warmup_key(cfg): run for run, cfg in reversed(list(RUNS.items()))}

# ESFT (train.method: esft): the routing totals (expensive) and the selection from them (cheap), keyed apart.
# Key -> the (first) run it serves, as WARMUPS.
ESFT_RUNS = [(run, cfg) for run, cfg in reversed(list(RUNS.items())) if cfg["train"]["method"] == "esft"]
ESFT_ROUTINGS = {stage_keys.esft_routing_key(cfg): run for run, cfg in ESFT_RUNS}
ESFT_SELECTIONS = {stage_keys.esft_selection_key(cfg): run for run, cfg in ESFT_RUNS}


def esft_totals(cfg):
    return f"{RESULTS}/esft/routing/{stage_keys.esft_routing_key(cfg)}/totals.json"


def esft_selection(cfg):
    """The expert selection (esft_select's output) the training stages of ``cfg`` take; none for other methods."""
    if cfg["train"]["method"] != "esft":
        return []
    return f"{RESULTS}/esft/selection/{stage_keys.esft_selection_key(cfg)}/selection.json"
CHECKPOINTS = f"{RESULTS}/checkpoints"  # resumable checkpoints, outside every declared output


def warmup_dir(cfg):
    return f"{RESULTS}/warmup/{stage_keys.warmup_key(cfg)}"


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
    from moeflow.workflow.report_card import CardFiles, RunFiles

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
        )
        for run, cfg in RUNS.items()
    ]
    return CardFiles(stack=STACK, stage=stage, runs=runs, logs=f"{RESULTS}/logs", paper=PAPER if evaluated else None)


def print_report_card():
    """After a finished ``train`` or ``paper`` (or no target: train), the card of every run, logged and written
    to REPORT_CARD. Snakemake calls no onsuccess after a dry run or a run with nothing to be done."""
    from snakemake.logging import logger

    from moeflow.workflow.report_card import card_stage, write_card

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
