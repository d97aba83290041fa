"""GPU jobs and their GPUs, on the CPU: every rule that uses a GPU declares ``resources.gpu`` from the config (the
training layout's ranks for warmup and train_model, evaluate.ranks for evaluate_model and lm_eval_task,
coverage.ranks for coverage_valset, one for the other forward-only stages), so ``--resources gpu=N`` keeps the GPU
jobs that run at once within N GPUs; and each job claims GPUs of its own (moeflow.runtime.devices), so jobs that
overlap never share one.

The dry run reads the declarations of the real workflow with a CUDA config. The run executes jobs of those
declared sizes for real, through the same two doors the rules use (a shell rule's launcher prefix,
``claim_command``; a script rule's ``Stage.start``), on stand-in GPUs (``CUDA_VISIBLE_DEVICES=0,1``): each job
records when it held which GPUs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import SMOKE, copy_workflow, only_on, snakemake

from moeflow.settings import REPO_ROOT

pytestmark = pytest.mark.pipeline
# the two runs execute stand-in jobs that compute nothing with torch: the claims and Snakemake's cap are stack-free
stack_free = only_on("pinned", "its jobs run no model: GPU claims and Snakemake's resources are the same on both")

FORWARD_ONLY = {"choose_experts"}
# evaluate_model, lm_eval_task and humaneval_generate: evaluate.ranks; coverage_valset: coverage.ranks;
# sharded like training
TRAINING = {
    "warmup",
    "train_model",
    "evaluate_model",
    "lm_eval_task",
    "humaneval_generate",
    "coverage_valset",
}
CUDA = {
    "hardware": {"device": "cuda", "num_devices": 2, "memory_gib_per_device": 80},
    "parallel": {"nproc_per_node": 2, "strategy": "fsdp"},
    "evaluate": {"ranks": 2},
    "coverage": {"ranks": 2},
}


def declared_gpus(out: str) -> dict[str, set[int]]:
    """The ``gpu`` resource of every job of a dry run's listing, by rule."""
    found: dict[str, set[int]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        head = re.match(r"(?:local)?rule (\w+):", block)
        if not head:
            continue
        resources = re.search(r"^\s+resources: (.*)$", block, re.M)
        gpu = re.search(r"\bgpu=(\d+)", resources.group(1)) if resources else None
        found.setdefault(head.group(1), set()).add(int(gpu.group(1)) if gpu else 0)
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("gpu_scheduling") / "moeflow")


def test_every_gpu_rule_declares_its_gpus_from_the_config(workdir):
    (workdir / "config" / "cuda.yaml").write_text(yaml.safe_dump(CUDA))
    out = snakemake(workdir, "paper", "-n", "--cores", "8", "--resources", "gpu=2", *SMOKE, "config/cuda.yaml").stdout
    gpus = declared_gpus(out)
    assert {rule: gpus[rule] for rule in TRAINING} == {rule: {2} for rule in TRAINING}, gpus
    assert {rule: gpus[rule] for rule in FORWARD_ONLY | {"pretrain_base"}} == {
        rule: {1} for rule in FORWARD_ONLY | {"pretrain_base"}
    }, gpus
    assert all(gpus[rule] == {0} for rule in set(gpus) - TRAINING - FORWARD_ONLY - {"pretrain_base"}), gpus
    # a training job's launcher claims its GPUs before torchrun starts
    assert re.search(
        r"-m moeflow\.runtime\.devices --gpus 2 --what 'rule warmup' -- \S+ -m torch\.distributed\.run", out
    )
    on_cpu = declared_gpus(snakemake(workdir, "paper", "-n", "--cores", "8", *SMOKE).stdout)
    assert set().union(*on_cpu.values()) == {0}, on_cpu


SNAKEFILE = """
import json
JOBS = json.load(open("jobs.json"))

rule all:
    input: [f"done/{name}.json" for name in JOBS]

rule shell_job:
    output: "done/{name}.json"
    wildcard_constraints: name="shell-.*"
    resources: gpu=lambda wc: JOBS[wc.name]
    params: claim=lambda wc, resources: claim_command(sys.executable, resources.gpu, wc.name)
    shell: "{params.claim}" + sys.executable + " record.py {output} {resources.gpu}"

rule script_job:
    output: "done/{name}.json"
    wildcard_constraints: name="script-.*"
    resources: gpu=lambda wc: JOBS[wc.name]
    params: runtime={"stack": "test", "precision": "fp32", "seed": 0}
    script: "stage_job.py"
"""

RECORD = """
import json, os, sys, time
start = time.time()
time.sleep(2.5)
json.dump({"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
           "gpus": int(sys.argv[2])}, open(sys.argv[1], "w"))
"""

STAGE_JOB = """
import json, os, time
from moeflow.runtime.stage import Stage
Stage.start(snakemake)
start = time.time()
time.sleep(2.5)
json.dump({"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
           "gpus": int(snakemake.resources.gpu)}, open(snakemake.output[0], "w"))
"""


def run_jobs(folder: Path, jobs: dict[str, int], *args: str) -> list[dict]:
    folder.mkdir()
    header = "import sys\nfrom moeflow.runtime.devices import claim_command\n"
    (folder / "Snakefile").write_text(header + SNAKEFILE)
    (folder / "jobs.json").write_text(json.dumps(jobs))
    (folder / "record.py").write_text(RECORD)
    (folder / "stage_job.py").write_text(STAGE_JOB)
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "0,1",  # two stand-in GPUs: nothing here touches CUDA
        "MOEFLOW_GPU_LOCK_DIR": str(folder / "locks"),
    }
    snakemake(folder, "all", "--cores", "8", "--workflow-profile", "none", *args, env=env)
    return [json.loads((folder / "done" / f"{name}.json").read_text()) | {"name": name} for name in jobs]


def overlapping(records: list[dict]) -> list[list[dict]]:
    """The sets of jobs running together, at each job's start."""
    return [[r for r in records if r["start"] <= at["start"] < r["end"]] for at in records]


# warmup (2 ranks) and the forward-only stages (one GPU each), as the dry run above declares them
JOBS = {"shell-warmup": 2, "script-coverage": 1, "script-evaluate": 1, "shell-drift": 1}


@stack_free
def test_no_more_gpu_jobs_run_at_once_than_gpus_declared(tmp_path):
    records = run_jobs(tmp_path / "capped", JOBS, "--resources", "gpu=2")
    assert len(records) == len(JOBS)
    for record in records:  # each job sees exactly its own GPUs
        assert len(record["devices"].split(",")) == record["gpus"], record
    for together in overlapping(records):
        assert sum(r["gpus"] for r in together) <= 2, together
        devices = [d for r in together for d in r["devices"].split(",")]
        assert len(devices) == len(set(devices)), together


@stack_free
def test_without_a_cap_the_claims_alone_keep_jobs_off_each_others_gpus(tmp_path):
    records = run_jobs(tmp_path / "uncapped", JOBS)
    for together in overlapping(records):
        devices = [d for r in together for d in r["devices"].split(",")]
        assert len(devices) == len(set(devices)), together
