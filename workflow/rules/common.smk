# Shared by all stage files: config validation, the stack, the runs, result paths, and the library
# modules each stage lists as inputs (Snakemake does not track code imported by a script otherwise).
# Functions live here only; workflow/rules/<stage>.smk hold rules only.

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

from moeflow import config as mfconfig
from moeflow.env import fingerprint as environment_fingerprint

try:
    mfconfig.validate(config)
    STACK = mfconfig.resolve_stack(config)
except mfconfig.ConfigError as exc:
    raise WorkflowError(f"moeflow: {exc}") from None

RESULTS = f"results/{STACK}"
ENV_FILE = f"envs/{STACK}.yaml"
RUNS = {name: mfconfig.run_config(config, name) for name in mfconfig.run_names(config)}
if not RUNS:
    raise WorkflowError("moeflow: the config defines no runs (config key 'runs'); add at least one, e.g. runs: {moe: {}}")

# Data stages are keyed by their own settings, so runs that agree on data share them.
TOKENIZERS = {mfconfig.tokenizer_key(cfg): mfconfig.tokenizer_settings(cfg) for cfg in RUNS.values()}
DATASETS = {mfconfig.data_key(cfg): mfconfig.data_settings(cfg) for cfg in RUNS.values()}


def lib(*modules):
    """The package modules a rule's script imports, as inputs: editing one reruns the rule."""
    base = ("__init__", "compat", "io", "stage", "config")
    return [f"src/moeflow/{m}.py" for m in dict.fromkeys(base + modules)]


def runtime(run=None):
    """Stack, precision and seed: recorded in every output, and part of every rule's params."""
    cfg = RUNS[run] if run else config
    return {"stack": STACK, "precision": cfg["precision"], "seed": cfg["seed"]}


def log_path(rule, *parts):
    return f"{RESULTS}/logs/{rule}/{'/'.join(parts) or rule}.log"


def bench_path(rule, *parts):
    return f"{RESULTS}/benchmarks/{rule}/{'/'.join(parts) or rule}.tsv"


# --- paths shared between stages


def tokenizer_dir(settings):
    """The tokenizer folder for a set of tokenizer settings: the pretrained model's, or one trained here."""
    return settings["pretrained_model"] or f"{RESULTS}/tokenizer/t-{mfconfig.stable_hash(settings)}"


def corpus_files(wc):
    """Source files of a corpus, so that editing one reruns the stage (stdlib is recorded in the manifest)."""
    from moeflow.corpus import source_files

    return source_files(DATASETS[wc.datakey]["data"]["sources"][wc.corpus])


def data_dir(cfg, corpus):
    return f"{RESULTS}/data/{mfconfig.data_key(cfg)}/{corpus}"


BASES = {mfconfig.base_key(cfg): cfg for cfg in RUNS.values() if not cfg["model"].get("pretrained")}


def base_model_dir(cfg):
    return cfg["model"].get("pretrained") or f"{RESULTS}/base/{mfconfig.base_key(cfg)}"


COVERAGES = {mfconfig.coverage_key(cfg): cfg for cfg in RUNS.values()}


def coverage_dir(cfg):
    return f"{RESULTS}/coverage/{mfconfig.coverage_key(cfg)}"


def run_targets(cfg, run):
    """Everything a run needs before fine-tuning starts."""
    return [
        f"{RESULTS}/runs/{run}/plan.json",
        f"{coverage_dir(cfg)}/coverage.json",
    ] + [data_dir(cfg, c) for c in [cfg["data"]["finetune_corpus"], *cfg["data"]["eval_corpora"]]]
