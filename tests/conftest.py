"""Shared fixtures. Unit tests import the package directly; only pipeline tests run Snakemake.

The smoke pipeline runs once per test session (``smoke_pipeline``); a test that changes something
works on its own copy (``pipeline_copy``), made with mtimes preserved so Snakemake sees it up to date.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from moeflow.config import REPO_ROOT
from moeflow.stage import set_offline

set_offline()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORKFLOW_FILES = ("Snakefile", "workflow", "config", "envs", "src", "tools", "profiles")


def active_stack() -> str:
    """The stack this interpreter belongs to (tests run in .venvs/pinned or .venvs/current)."""
    return "current" if int(metadata.version("transformers").split(".")[0]) >= 5 else "pinned"


def snakemake(workdir: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake (this interpreter's) in ``workdir``; the target must come first in ``args``."""
    run_env = {**os.environ, "STACK": active_stack(), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir, env=run_env, capture_output=True, text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def copy_workflow(dest: Path, source: Path = REPO_ROOT) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def smoke_pipeline(tmp_path_factory) -> Path:
    """A finished smoke pipeline (config/smoke.yaml, target ``paper``: every stage) in its own folder.
    Tests only read it or dry-run against it; a test that changes something uses ``pipeline_copy``."""
    workdir = copy_workflow(tmp_path_factory.mktemp("smoke") / "moeflow")
    snakemake(workdir, "paper", "--cores", "2", "--configfile", "config/smoke.yaml")
    return workdir


@pytest.fixture
def pipeline_copy(smoke_pipeline, tmp_path) -> Path:
    """A private copy of the finished smoke pipeline (``.snakemake`` included, mtimes preserved)."""
    dest = tmp_path / "moeflow"
    shutil.copytree(smoke_pipeline, dest, symlinks=True, copy_function=shutil.copy2)
    return dest
