"""The SLURM profiles, tested by submitting through stand-in SLURM commands that record their command lines.

Nothing heavy runs: the workflow is copied to a temporary folder, every output upstream of the training
rule is faked (empty, so Snakemake sees it done), and the stand-in ``sbatch`` records the submission
and refuses it, which ends the run before any job starts.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow, snakemake

from moeflow.settings import REPO_ROOT

pytest.importorskip("snakemake_executor_plugin_slurm")

PROFILES = REPO_ROOT / "profiles"
TRAINING_RULES = ("pretrain_base", "warmup", "train_model")
JOB_ID = "4242"

# One script for every SLURM command: it appends {"cmd", "argv", "stdin"} to $SLURM_STANDIN_LOG and
# answers what the executor plugin asks. sbatch records the job script and fails, so nothing runs.
STANDIN = f"""#!{sys.executable}
import json, os, sys
cmd = os.path.basename(sys.argv[0])
stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
with open(os.environ["SLURM_STANDIN_LOG"], "a") as log:
    log.write(json.dumps({{"cmd": cmd, "argv": sys.argv[1:], "stdin": stdin}}) + "\\n")
args = " ".join(sys.argv[1:])
if cmd == "sbatch":
    sys.stderr.write("stand-in sbatch: submission recorded, not run\\n")
    sys.exit(1)
if cmd in ("sacctmgr", "sshare") or (cmd == "sacct" and "Account" in args):
    print("standin-account")
elif cmd == "sacct":
    print("{JOB_ID}|FAILED")
elif cmd == "sinfo":
    print("gpu")
"""


@pytest.fixture
def slurm_bin(tmp_path) -> tuple[Path, Path]:
    """A folder of stand-in SLURM commands and the file they record into."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for cmd in ("sbatch", "srun", "sacct", "squeue", "scontrol", "sinfo", "sacctmgr", "sshare", "scancel"):
        path = bin_dir / cmd
        path.write_text(STANDIN)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, tmp_path / "slurm-calls.jsonl"


def summary(workdir: Path, *targets: str) -> list[dict[str, str]]:
    """Snakemake's ``--summary`` of the targets: one row per output file with its rule."""
    out = snakemake(
        workdir, *targets, "--configfile", "config/smoke.yaml", "--summary", "--workflow-profile", "none"
    ).stdout
    lines = [line.split("\t") for line in out.splitlines() if "\t" in line]
    header, rows = lines[0], lines[1:]
    return [dict(zip(header, row)) for row in rows]


def fake_everything_but(workdir: Path, rows: list[dict[str, str]], rule: str) -> list[str]:
    """Create every output of the other rules (folders for extension-less paths), all with one mtime newer
    than the copied sources; return the outputs of ``rule``."""
    stamp = time.time()
    for row in rows:
        if row["rule"] == rule:
            continue
        path = workdir / row["output_file"]
        if path.suffix:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            path.mkdir(parents=True, exist_ok=True)
        os.utime(path, (stamp, stamp))
    return [row["output_file"] for row in rows if row["rule"] == rule]


def submit(workdir: Path, slurm_bin: tuple[Path, Path], target: str, profile: str) -> dict:
    """Run Snakemake with ``profile`` on ``target``; return the recorded sbatch call (argv and script)."""
    bin_dir, calls = slurm_bin
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_STANDIN_LOG": str(calls)}
    proc = snakemake(
        workdir,
        target,
        "--configfile",
        "config/smoke.yaml",
        "--workflow-profile",
        str(PROFILES / profile),
        check=False,
        env=env,
    )
    assert proc.returncode != 0, "the stand-in sbatch refuses every submission"
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.is_file() else []
    sbatch = [c for c in recorded if c["cmd"] == "sbatch"]
    assert sbatch, f"nothing was submitted:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return sbatch[0]


def option(argv: list[str], *names: str) -> str | None:
    """The value of an sbatch option given as ``--name value``, ``--name=value`` or ``-x value``."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def profile_resources(profile: str, rule: str) -> dict:
    cfg = yaml.safe_load((PROFILES / profile / "config.yaml").read_text())
    return cfg["default-resources"] | cfg["set-resources"].get(rule, {})


def test_default_profile_is_minimal_and_local():
    cfg = yaml.safe_load((PROFILES / "default" / "config.yaml").read_text())
    assert "executor" not in cfg and "rerun-incomplete" not in cfg
    assert cfg == {"printshellcmds": True}


@pytest.mark.parametrize("profile", ["slurm", "slurm-multinode"])
def test_profile_is_for_the_slurm_plugin_with_gpu_training_rules(profile):
    cfg = yaml.safe_load((PROFILES / profile / "config.yaml").read_text())
    assert cfg["executor"] == "slurm"
    for rule in ("warmup", "train_model"):
        res = cfg["set-resources"][rule]
        assert res["slurm_partition"] and res["gpu"] >= 8 and res["gpu_model"] and res["mem_mb"] and res["runtime"]
        assert res["gpu"] % res["nodes"] == 0, "the same number of GPUs on every node"


@pytest.fixture(scope="module")
def ready_for_training(tmp_path_factory) -> tuple[Path, str, str]:
    """A workflow copy where only the last training rule (train_model) of the DAG of ``train`` and
    ``evaluate`` is left to run: (folder, rule, its first output)."""
    workdir = copy_workflow(tmp_path_factory.mktemp("cluster") / "moeflow")
    rows = summary(workdir, "train", "evaluate")
    rule = next((r for r in reversed(TRAINING_RULES) if any(row["rule"] == r for row in rows)), None)
    assert rule is not None, f"no training rule ({', '.join(TRAINING_RULES)}) in the DAG of 'train'"
    return workdir, rule, fake_everything_but(workdir, rows, rule)[0]


@pytest.mark.parametrize("profile", ["slurm", "slurm-multinode"])
def test_training_rule_is_submitted_with_the_profiles_partition_gpus_memory_and_time(
    tmp_path, slurm_bin, ready_for_training, profile
):
    source, rule, target = ready_for_training
    workdir = tmp_path / "moeflow"
    shutil.copytree(source, workdir, symlinks=True, copy_function=shutil.copy2)  # mtimes kept: still up to date

    call = submit(workdir, slurm_bin, target, profile)
    argv = shlex.split(" ".join(call["argv"]))
    want = profile_resources(profile, rule)
    assert option(argv, "-p", "--partition") == want["slurm_partition"]
    assert option(argv, "--gpus") == f"{want['gpu_model']}:{want['gpu']}"
    assert option(argv, "--mem") == str(want["mem_mb"])
    assert option(argv, "-t", "--time") == str(want["runtime"])
    if "nodes" in want:
        assert option(argv, "--nodes") == str(want["nodes"])
    for extra in shlex.split(want.get("slurm_extra", "").strip("'")):
        assert extra in argv
    # the job script runs the rule inside the allocation through the jobstep executor
    script = call["stdin"] + " ".join(call["argv"])
    assert "slurm-jobstep" in script and rule in script
