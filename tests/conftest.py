"""Shared fixtures. Unit tests import the package directly; only pipeline tests run Snakemake.

The smoke pipeline runs once per test session (``smoke_pipeline``); a test that changes something
works on its own copy (``pipeline_copy``), made with mtimes preserved so Snakemake sees it up to date.

Two tiers (docs/testing.md): every test under tests/pipeline is marked ``full`` (``make test-all``) unless it
is marked ``fast`` (``make test``: the unit tests, the smoke pipeline and the cheap tests that read it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import yaml

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.runtime.stage import set_offline
from moeflow.settings import REPO_ROOT

set_offline()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Outputs a rerun does not reproduce byte for byte: measured seconds and memory; an unseeded generator's state.
NOT_REPRODUCED = ("timings.json", "phase_peaks.json", "rng.safetensors")
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "envs", "src", "tools", "profiles")


def serve_python() -> Path | None:
    """The serving environment's Python (``make serve-env``) the tests check exports with: MOEFLOW_SERVE_PYTHON, else
    .venvs/serve's if it is installed, else None (the serving tests skip; the smoke pipeline has no serve_check). CI
    sets the variable, and a path it names must exist."""
    named = os.environ.get("MOEFLOW_SERVE_PYTHON")
    if named:
        if not Path(named).is_file():
            raise pytest.UsageError(f"MOEFLOW_SERVE_PYTHON={named} does not exist: run `make serve-env`")
        return Path(named).absolute()  # not resolved: a venv's python is a link to the interpreter it was made from
    default = REPO_ROOT / ".venvs" / "serve" / "bin" / "python"
    return default if (REPO_ROOT / ".venvs" / "serve" / ".installed").is_file() else None


def active_stack() -> str:
    """The stack this interpreter belongs to (tests run in .venvs/pinned or .venvs/current)."""
    return "current" if int(metadata.version("transformers").split(".")[0]) >= 5 else "pinned"


SERVE_PYTHON = serve_python()
needs_serve_env = pytest.mark.skipif(SERVE_PYTHON is None, reason="no serving environment (make serve-env)")
# The smoke pipeline's serve.python: on the current stack only. The rule's wiring is one, every serving test runs on
# current, and the pinned stack's saved folders are served in tests/unit/test_serve_check.py; its two checks cost the
# pinned suite minutes in CI.
SMOKE_SERVE_PYTHON = SERVE_PYTHON if active_stack() == "current" else None


def in_smoke(rules: set[str]) -> set[str]:
    """``rules`` as the smoke pipeline has them: without serve_check where it has no serving environment (and
    without the paper where serve_check's record was all that reran it)."""
    if SMOKE_SERVE_PYTHON or "serve_check" not in rules:
        return set(rules)
    rest = set(rules) - {"serve_check"}
    return set() if rest == {"paper"} else rest


def only_on(stack: str, why: str) -> pytest.MarkDecorator:
    """Run a stack-independent test on one stack only (``why``: what makes it the same on both). .ci/run runs the
    two stacks' suites side by side, so such a test is put on the stack that keeps their times even."""
    return pytest.mark.skipif(active_stack() != stack, reason=f"runs on the {stack} stack only: {why}")


PIPELINE_TESTS = Path(__file__).resolve().parent / "pipeline"


def pytest_collection_modifyitems(config, items):
    """The tiers: a test under tests/pipeline is ``full`` unless marked ``fast``."""
    for item in items:
        if PIPELINE_TESTS in item.path.parents and item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.full)


def workflow_env(workdir: Path, **env: str) -> dict[str, str]:
    """This environment for Snakemake in ``workdir``, a copy of the workflow: its own src/ first on PYTHONPATH
    (common.smk refuses a moeflow imported from anywhere else) before ``env``'s or this one's PYTHONPATH, the
    active stack, and ``env``."""
    rest = env.pop("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join([str(Path(workdir).resolve() / "src"), *filter(None, rest.split(os.pathsep))])
    return {**os.environ, "STACK": active_stack(), **env, "PYTHONPATH": path}


def snakemake(workdir: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake (this interpreter's) in ``workdir``; the target must come first in ``args``."""
    run_env = workflow_env(workdir, **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        env=run_env,
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
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
    if SMOKE_SERVE_PYTHON:  # every export checked in vLLM too (rule serve_check), as config/serve.yaml asks
        smoke = workdir / "config" / "smoke.yaml"
        smoke.write_text(smoke.read_text() + yaml.safe_dump({"serve": {"python": str(SMOKE_SERVE_PYTHON)}}))
    snakemake(workdir, "paper", "--cores", "2", "--configfile", "config/smoke.yaml")
    return workdir


@pytest.fixture
def pipeline_copy(smoke_pipeline, tmp_path) -> Path:
    """A private copy of the finished smoke pipeline (``.snakemake`` included, mtimes preserved)."""
    dest = tmp_path / "moeflow"
    shutil.copytree(smoke_pipeline, dest, symlinks=True, copy_function=shutil.copy2)
    return dest


# --------------------------------------------------------------------------- the smoke pipeline's dry runs

SMOKE = ("--configfile", "config/smoke.yaml")


def scheduled_rules(workdir: Path, *overlays: str, target: str = "train") -> set[str]:
    """The rules a dry run would execute with the smoke config plus ``overlays`` (from the job-stats table)."""
    return job_stats_rules(snakemake(workdir, target, "--dry-run", "--cores", "2", *SMOKE, *overlays).stdout)


def executed_rules(proc: subprocess.CompletedProcess) -> set[str]:
    """The rules a (real) Snakemake run executed, from the job-stats table it logs before starting: what the
    dry run before it would have shown, without the second Snakemake start (CI time)."""
    return job_stats_rules(proc.stderr)


def job_stats_rules(out: str) -> set[str]:
    if "Job stats:" not in out:
        assert "Nothing to be done" in out, out[-3000:]
        return set()
    table = out.split("Job stats:", 1)[1]
    rules = set()
    for line in table.splitlines()[3:]:
        fields = line.split()
        if not fields or fields[0] == "total":
            break
        rules.add(fields[0])
    return rules


def write_overlay(workdir: Path, overlay: dict) -> str:
    path = workdir / "config" / "change.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return "config/change.yaml"


def results(workdir: Path) -> Path:
    return workdir / "results" / active_stack()


PLAN_TOLERANCE = 0.15  # a phase's measured peak / the memory plan's figure for it, within 1 +- this (issue #38)


def phases_against_plan(run: Path) -> list[tuple[str, int, int]]:
    """A finished run's (phase, planned, measured) as the report card sets them side by side
    (moeflow.workflow.report_card.phase_comparison); fails unless every phase of the plan was measured (warmup's
    load, train_model's resume, steps, checkpoints and export) within ``PLAN_TOLERANCE``."""
    from moeflow.plan.memory import PHASES
    from moeflow.train.peak_memory import PHASE_PEAKS_FILE
    from moeflow.workflow.report_card import phase_comparison

    plan = json.loads((run / "plan.json").read_text())
    measured = json.loads((run / "train" / PHASE_PEAKS_FILE).read_text())
    assert set(measured["stages"]["warmup"]) >= {"load", "step"}, measured
    assert set(measured["stages"]["train_model"]) == {"resume", "step", "checkpoint", "export"}, measured
    rows = phase_comparison(plan, measured)
    assert [phase for phase, _, _ in rows] == list(PHASES)
    off = {phase: round(got / planned, 3) for phase, planned, got in rows if abs(got / planned - 1) > PLAN_TOLERANCE}
    assert not off, f"{run}: measured / planned memory outside 1 +- {PLAN_TOLERANCE}: {off}"
    return rows


# --------------------------------------------------------------------------- a tokenized corpus and a saved tiny MoE


def _corpus_text(i: int, rng) -> str:
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "print",
        "return",
        "class",
        "import",
        "while",
        "lambda",
        "yield",
        "42",
        "(",
        ")",
        ":",
    ]
    return " ".join(rng.choice(words, int(rng.integers(4, 30)))) + f" # doc {i}\n"


@pytest.fixture(scope="module")
def coverage_inputs(tmp_path_factory):
    """A tokenized corpus (train/heldout/test) and a tiny qwen3_moe saved with its tokenizer."""
    from tiny_models import tiny_model_cfg

    from moeflow.data.sharding import TokenizeStage, tokenize_corpus
    from moeflow.data.tokenizer import TrainTokenizerStage, load_fast_tokenizer, train_tokenizer_stage
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    root = tmp_path_factory.mktemp("coverage_stage")
    rng = np.random.default_rng(0)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": _corpus_text(i, rng)}) + "\n" for i in range(160)))
    sources = {"code": {"type": "jsonl", "path": str(root / "docs.jsonl")}}
    split = {"heldout": 0.5, "test": 0.1}
    tok = {
        "tokenizer": {"vocab_size": 300, "min_frequency": 2},
        "pretrained_model": None,
        "sources": sources,
        "split": split,
        "on_bad_record": "fail",
    }
    data = {
        "seq_len": 64,
        "pad_to_multiple_of": 8,
        "on_bad_record": "fail",
        "split": split,
        "shard_max_bytes": 1 << 20,
        "sources": sources,
    }
    train_tokenizer_stage(typed(TrainTokenizerStage, tok), root / "tokenizer")
    tokenize_corpus("code", typed(TokenizeStage, {"tokenizer": tok, "data": data}), root / "tokenizer", root / "code")
    tokenizer = load_fast_tokenizer(root / "tokenizer")
    model_cfg = tiny_model_cfg(tie_word_embeddings=False)
    model = make_model(typed(ModelSettings, model_cfg), vocab_size=len(tokenizer), seed=0)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root, model_cfg


def run_coverage_stage(root: Path, model_cfg, out: Path, **overrides):
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    settings = {
        "pool_corpora": ["code"],
        "min_docs_per_expert": 2,
        "min_tokens": 1,
        "pairs_per_layer": 2,
        "token_budget": 1500,
        "batch_tokens": 128,
        "allow_unmet": False,
        "random_draws": 3,
    } | overrides
    outputs = StageOutputs(out / "valset", out / "coverage.json", out / "heatmap.png")
    model = make_model(typed(ModelSettings, model_cfg), folder=root / "base")
    return build_valset(
        model,
        [root / "code"],
        settings,
        outputs,
        model_cfg["attn_implementation"],
        seed=1234,
        provenance={"stage": "test"},
    ), outputs
