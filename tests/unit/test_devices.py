"""moeflow.runtime.devices: a job's claim of GPUs of its own (on stand-in GPUs: nothing touches CUDA)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from moeflow.runtime.devices import DeviceError, claim, claim_command
from moeflow.settings import REPO_ROOT

HOLD = (
    "from moeflow.runtime.devices import claim; import os; claim({n}); "
    "print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); input()"
)
TRY = (
    "from moeflow.runtime.devices import claim; import os; claim({n}, timeout_s=1.0, poll_s=0.1); "
    "print(os.environ['CUDA_VISIBLE_DEVICES'])"
)


def env(tmp_path, visible="0,1,2"):
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT / "src"),
        "CUDA_VISIBLE_DEVICES": visible,
        "MOEFLOW_GPU_LOCK_DIR": str(tmp_path / "locks"),
    }


def test_a_claim_gets_gpus_no_other_job_holds_and_waits_when_none_are_free(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(n=2)],
        env=env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = holder.stdout.readline().split()[0].split(",")
        assert held == ["0", "1"]
        other = subprocess.run(
            [sys.executable, "-c", TRY.format(n=1)], env=env(tmp_path), capture_output=True, text=True
        )
        assert other.returncode == 0 and other.stdout.split() == ["2"], other.stderr  # the one GPU left
        busy = subprocess.run(
            [sys.executable, "-c", TRY.format(n=2)], env=env(tmp_path), capture_output=True, text=True
        )
        assert busy.returncode != 0 and "did not come free" in busy.stderr
    finally:
        holder.communicate("\n")
    # the holder exited: its GPUs are free again
    again = subprocess.run([sys.executable, "-c", TRY.format(n=3)], env=env(tmp_path), capture_output=True, text=True)
    assert again.stdout.split() == ["0,1,2"], again.stderr


def test_the_launcher_prefix_keeps_the_claim_while_its_command_runs(tmp_path):
    child = (
        "import os, subprocess, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); "
        f"print(subprocess.run([sys.executable, '-c', {TRY.format(n=1)!r}], capture_output=True).returncode)"
    )
    command = claim_command(sys.executable, 2, "rule warmup") + f"{sys.executable} -c {shlex.quote(child)}"
    done = subprocess.run(["bash", "-c", command], env=env(tmp_path), capture_output=True, text=True)
    assert done.stdout.split() == ["0,1", "1"], done.stderr  # the exec'd command still holds both
    assert claim_command(sys.executable, 0, "rule x") == ""


def test_more_gpus_than_the_machine_shows_is_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a job that claims before importing torch
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("MOEFLOW_GPU_LOCK_DIR", str(tmp_path))
    with pytest.raises(DeviceError, match="asks for 2 GPU.*resources.gpu.*parallel.nproc_per_node"):
        claim(2, what="rule warmup")
    assert claim(0) == [] and os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_claim_after_torch_was_imported_is_refused(tmp_path, monkeypatch):
    """#36 item 8: CUDA takes CUDA_VISIBLE_DEVICES at its first device query, which transformers' import makes:
    choose_experts imported torch before Stage.start claimed its GPU, so it timed on cuda:0 beside another job."""
    import torch  # noqa: F401 (imported: what the refusal is about)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("MOEFLOW_GPU_LOCK_DIR", str(tmp_path))
    with pytest.raises(DeviceError, match="rule choose_experts claims its 1 GPU.*after torch was imported"):
        claim(1, what="rule choose_experts")
    assert claim(0) == []  # a job without GPUs claims nothing, whatever it imported


def test_script_rules_with_gpus_claim_before_importing_anything_that_imports_torch():
    """A ``script:`` rule that may declare GPUs claims them in Stage.start: what its script imports before that call
    does not import torch (the torchrun rules claim in their launcher prefix, before Python)."""
    import ast
    import re

    from moeflow.settings import REPO_ROOT

    blocks = [
        block for smk in (REPO_ROOT / "workflow" / "rules").glob("*.smk") for block in smk.read_text().split("\nrule ")
    ]
    scripts = {
        script for block in blocks if "gpu=" in block for script in re.findall(r'scripts/(\w+\.py)"\s*$', block, re.M)
    }
    scripts = {s for s in scripts if any(f'script:\n        "../scripts/{s}"' in block for block in blocks)}
    assert scripts == {"choose_experts.py", "serve_check.py"}
    for script in scripts:
        body = ast.parse((REPO_ROOT / "workflow" / "scripts" / script).read_text()).body
        start = next(i for i, node in enumerate(body) if "Stage.start" in ast.unparse(node))
        before = [ast.unparse(node) for node in body[:start] if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert "from moeflow.runtime.stage import Stage" in before, (script, before)
        probe = "\n".join([*before, "import sys", "assert 'torch' not in sys.modules, sorted(sys.modules)"])
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert result.returncode == 0, (script, before, result.stderr[-2000:])
