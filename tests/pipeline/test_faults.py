"""Faults: a run killed with SIGKILL, or a disk that fills up, loses nothing.

- ``kill -9`` during coverage, warmup and evaluation (tokenization: tests/test_tokenize.py, training:
  tests/test_train.py): each test stops one stage of a copy of the finished smoke pipeline at a chosen
  ``moeflow.runtime.stage.kill_point``, reruns that stage with ``--rerun-incomplete``, and checks the outputs equal
  the uninterrupted ones (bytes; the same losses and weights for warmup, which resumes from its checkpoint).
  Coverage and evaluation are killed together with Snakemake (``MOEFLOW_KILL_SCOPE=group``), between two
  of their outputs: the rerun must refuse the half-finished job until told ``--rerun-incomplete``. These
  run on the pinned stack (the issue allows it: they are the slow part).
- A disk that fills up while a data shard or a training checkpoint is written: the previous output or
  checkpoint survives, nothing half-written sits under an output's name, and the error names the path.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NOT_REPRODUCED, active_stack, only_on, snakemake, workflow_env  # noqa: E402

from moeflow.runtime.files import DiskFull  # noqa: E402
from moeflow.runtime.stage import KILL_ENV, KILL_SCOPE_ENV  # noqa: E402
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import warmup_key
from moeflow.workflow.load import load, run_config

SMOKE_ARGS = ("--cores", "2", "--configfile", "config/smoke.yaml")


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def snakemake_killed_with_its_jobs(workdir: Path, *args: str, kill_at: str) -> subprocess.CompletedProcess:
    """Run Snakemake in its own session and let the stage SIGKILL the whole session at ``kill_at``: Snakemake
    dies with its job, as in a power cut, leaving its incomplete-job markers behind."""
    env = workflow_env(workdir, **{KILL_ENV: kill_at, KILL_SCOPE_ENV: "group"})
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"Snakemake was not killed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


# The fault matrix reruns real stages (about a minute each on 2 shared cores), so it runs on one stack; the
# code it exercises (kill points, atomic outputs, checkpoints, Snakemake's incomplete markers) is the same on both.
fault_matrix = only_on("pinned", "the kill -9 fault matrix is slow and exercises the same code on both")


def rerun_after_a_crash(workdir: Path, *args: str, incomplete: Path) -> None:
    """What a user does after the run was killed: unlock, and rerun with ``--rerun-incomplete``. Without
    it Snakemake refuses, naming the output the killed job left behind (complete-looking, not trusted)."""
    snakemake(workdir, *args, "--unlock")
    refused = snakemake(workdir, *args, check=False)
    message = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "IncompleteFilesException" in message, message[-3000:]
    assert str(incomplete.relative_to(workdir)) in message
    snakemake(workdir, *args, "--rerun-incomplete")


def _one(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


# --------------------------------------------------------------------------- kill -9, through Snakemake


@pytest.mark.pipeline
@fault_matrix
def test_coverage_killed_between_its_outputs_reruns_to_the_same_bytes(pipeline_copy):
    results = pipeline_copy / "results" / active_stack()
    folder = _one(sorted((results / "coverage").glob("c-*")))
    reference = files_of(folder)
    target = str((folder / "coverage.json").relative_to(pipeline_copy))

    snakemake_killed_with_its_jobs(
        pipeline_copy, target, *SMOKE_ARGS, "--forcerun", "coverage_valset", kill_at="coverage.after_valset"
    )
    assert (folder / "valset" / "manifest.json").is_file() and not (folder / "coverage.json").exists()
    rerun_after_a_crash(pipeline_copy, target, *SMOKE_ARGS, incomplete=folder / "valset")
    rerun = files_of(folder)
    assert rerun.keys() == reference.keys()
    assert [name for name in reference if rerun[name] != reference[name]] == []


@pytest.mark.pipeline
@fault_matrix
def test_evaluation_killed_between_its_outputs_reruns_to_the_same_metrics(pipeline_copy):
    out = pipeline_copy / "results" / active_stack() / "runs" / "moe" / "eval"
    reference = files_of(out)
    target = str((out / "metrics.json").relative_to(pipeline_copy))

    snakemake_killed_with_its_jobs(
        pipeline_copy, target, *SMOKE_ARGS, "--forcerun", "evaluate_run", kill_at="evaluate.write"
    )
    assert (out / "speed.json").is_file() and not (out / "metrics.json").exists()
    rerun_after_a_crash(pipeline_copy, target, *SMOKE_ARGS, incomplete=out / "speed.json")
    rerun = files_of(out)
    assert rerun["metrics.json"] == reference["metrics.json"] and rerun["summary.md"] == reference["summary.md"]
    # speed.json holds measured throughput and memory: same keys, fresh figures
    speed, before = json.loads(rerun["speed.json"]), json.loads(reference["speed.json"])
    assert speed.keys() == before.keys() and speed["provenance"] == before["provenance"]


@pytest.mark.pipeline
@fault_matrix
def test_warmup_killed_after_a_checkpoint_resumes_to_the_same_weights_and_losses(pipeline_copy):
    """A warmup of 4 steps with a checkpoint every 2: killed at step 3, the rerun continues from step 2."""
    overlay = pipeline_copy / "config" / "change.yaml"
    overlay.write_text("train: {warmup_steps: 4, checkpoint_every: 2}\n")
    cfg = run_config(load(pipeline_copy / "config" / "smoke.yaml", overlay), "moe")
    results = pipeline_copy / "results" / active_stack()
    folder = results / "warmup" / warmup_key(cfg)
    args = (
        str(folder.relative_to(pipeline_copy)),
        "--cores",
        "2",
        "--configfile",
        "config/smoke.yaml",
        "config/change.yaml",
    )

    snakemake(pipeline_copy, *args)
    reference = files_of(folder)
    killed = snakemake(pipeline_copy, *args, "--forcerun", "warmup", check=False, env={KILL_ENV: "warmup.step3"})
    assert killed.returncode != 0 and not folder.exists()
    _one(sorted((results / "checkpoints").glob("warmup-*/step-00000002")))

    snakemake(pipeline_copy, *args, "--rerun-incomplete")
    log = (results / "logs" / "warmup" / f"{folder.name}.log").read_text()
    assert re.search(r"warmup: continuing from \S+/step-00000002 at step 2", log), log[-2000:]
    rerun = files_of(folder)
    assert rerun.keys() == reference.keys()
    # Bit-identical weights, optimizer state, losses and routing report. Not compared: timings.json (measured
    # seconds), phase_peaks.json (measured memory) and rng.safetensors (the trainer does not seed torch's global
    # generator, whose seed differs in every process; nothing in these steps draws from it, so the losses do not
    # depend on it).
    assert [name for name in reference if name not in NOT_REPRODUCED and rerun[name] != reference[name]] == []
    state = json.loads(rerun["trainer_state.json"])
    assert [r["step"] for r in state["history"] if r["kind"] == "train"] == [1, 2, 3, 4]
    assert not list((results / "checkpoints").glob("warmup-*"))  # removed once the stage succeeded


def test_a_temporary_left_by_a_killed_writer_is_removed_by_the_next_run(coverage_inputs, tmp_path):  # noqa: F811
    """Killed before its rename, a stage leaves only a hidden temporary (never the output's name); the
    rerun removes it, so a crash does not leave gigabytes behind."""
    from moeflow.data.sharding import TokenizeStage, tokenize_corpus

    root, _ = coverage_inputs
    settings = json.loads((root / "code" / "manifest.json").read_text())["settings"]
    out = tmp_path / "data" / "code"
    code = (
        "from moeflow.data.sharding import TokenizeStage, tokenize_corpus; from moeflow.settings import typed; "
        f"tokenize_corpus('code', typed(TokenizeStage, {settings!r}), {str(root / 'tokenizer')!r}, {str(out)!r})"
    )
    env = {
        **os.environ,
        KILL_ENV: "tokenize.before_rename",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = [p.name for p in out.parent.iterdir()]
    assert len(left) == 1 and left[0].startswith(".code.") and left[0].endswith(".tmp") and not out.exists()
    tokenize_corpus("code", typed(TokenizeStage, settings), root / "tokenizer", out)
    assert [p.name for p in out.parent.iterdir()] == ["code"]
    assert files_of(out)["manifest.json"] == (root / "code" / "manifest.json").read_bytes()


# --------------------------------------------------------------------------- disk full


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_while_writing_a_shard_keeps_the_previous_output(coverage_inputs, tmp_path, monkeypatch):  # noqa: F811
    from moeflow.data.sharding import TokenizeStage, tokenize_corpus
    from moeflow.data.shards import SHARD_PATTERN, ShardWriter

    root, _ = coverage_inputs
    settings = json.loads((root / "code" / "manifest.json").read_text())["settings"]
    settings["data"]["shard_max_bytes"] = 1024  # several shards per split: the disk fills up midway
    settings = typed(TokenizeStage, settings)
    out = tmp_path / "data" / "code"
    tokenize_corpus("code", settings, root / "tokenizer", out)
    before = files_of(out)
    assert len([name for name in before if name.startswith("train/shard-")]) > 2

    opened = []
    original_open = ShardWriter._open

    def open_until_full(self):
        if len(opened) == 2:
            raise _no_space(self.out_dir / SHARD_PATTERN.format(len(self.shards)))
        opened.append(1)
        original_open(self)

    monkeypatch.setattr(ShardWriter, "_open", open_until_full)
    with pytest.raises(DiskFull) as err:
        tokenize_corpus("code", settings, root / "tokenizer", out)
    assert err.value.errno == errno.ENOSPC
    assert re.fullmatch(
        rf"\[Errno 28\] disk full while writing {re.escape(str(out))} "
        rf"\(at {re.escape(str(out.parent))}/\.code\.[^/]+\.tmp/(train|heldout|test)/shard-\d{{5}}\.arrow\): "
        r"its previous version is unchanged\. "
        rf"Free space on that filesystem \(df -h {re.escape(str(out.parent))}\) and rerun",
        str(err.value),
    ), str(err.value)
    assert files_of(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["code"]  # no half-written temporary left behind


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from tiny_training import losses, make_trainer, settings

    from moeflow.checkpoint import storage as checkpoint_storage
    from moeflow.checkpoint.state import latest_checkpoint

    whole = make_trainer()
    whole.run()
    checkpoints = tmp_path / "checkpoints"
    trainer = make_trainer(checkpoint_dir=checkpoints, train_settings=settings(checkpoint_every=2))
    real_writer = checkpoint_storage.SafetensorsWriter

    class WriterUntilFull(real_writer):
        def write(self, name, tensor):
            if "step-00000004" in str(self.path):  # a partial file, then no space left
                raise _no_space(self.path)
            super().write(name, tensor)

    monkeypatch.setattr(checkpoint_storage, "SafetensorsWriter", WriterUntilFull)
    with pytest.raises(DiskFull) as err:
        trainer.run()
    step4 = checkpoints / "step-00000004"
    assert re.fullmatch(
        rf"\[Errno 28\] disk full while writing {re.escape(str(step4))} "
        rf"\(at {re.escape(str(checkpoints))}/\.step-00000004\.partial/shard-0\.safetensors\): "
        r"nothing was written under that name\. "
        rf"Free space on that filesystem \(df -h {re.escape(str(checkpoints))}\) and rerun",
        str(err.value),
    ), str(err.value)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(checkpoints) == checkpoints / "step-00000002"

    monkeypatch.setattr(checkpoint_storage, "SafetensorsWriter", real_writer)  # space freed: resume, lose nothing
    resumed = make_trainer(checkpoint_dir=checkpoints, train_settings=settings(checkpoint_every=2))
    assert resumed.resume() and resumed.step == 2
    resumed.run()
    assert losses(resumed) == losses(whole)
