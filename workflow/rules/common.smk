# Shared by every rule file: config validation, the stack, the runs, result paths and the library
# modules each rule lists as inputs (Snakemake does not track code imported by a script otherwise).

import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

SRC = Path(workflow.basedir) / "src"
sys.path.insert(0, str(SRC))
# Stage scripts run in their own interpreter (the rule's conda env, or Snakemake's own Python):
# they find the moeflow package through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
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

wildcard_constraints:
    run="[A-Za-z0-9][A-Za-z0-9_.-]*",
    tokkey="t-[0-9a-f]+",
    datakey="d-[0-9a-f]+",


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
