"""The GPU check's driver in dry mode, its cheap half (the benchmark at test sizes on the CPU, in the suite's own
environment; .ci/run runs the whole dry mode, in the mimic of the GPU machine with the wheel bundle): it completes
and its report holds, for moeflow's Trainer and the HF Trainer, the numbers the GPU run is read for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import active_stack

from moeflow.settings import REPO_ROOT

NUMBERS = (
    "tokens_per_s",
    "seconds_per_step",
    "mfu",
    "mfu_layers",
    "peak_allocated_mib",
    "host_syncs_per_step",
    "active_parameters",
    "total_parameters",
)
NAMES = ("attn_implementation", "experts_implementation", "weights_dtype")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0


def test_the_dry_run_reports_both_trainers_numbers(tmp_path):
    out = tmp_path / "gpu_acceptance.json"
    env = {**os.environ, "STACK": active_stack(), "OMP_NUM_THREADS": "1", "GPU_ACCEPTANCE_PYTHON": sys.executable}
    done = subprocess.run(
        [str(REPO_ROOT / "benchmarks" / "gpu_acceptance.sh"), "--dry", "--skip-smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry"] is True and report["device"] == "cpu"
    assert set(report["setups"]) == {"moeflow", "hf_trainer"}
    for setup, numbers in report["setups"].items():
        for key in NUMBERS:
            assert is_number(numbers[key]), (setup, key, numbers[key])
        for key in NAMES:
            assert isinstance(numbers[key], str) and numbers[key], (setup, key)
        assert numbers["tokens_per_s"] > 0 and 0 < numbers["mfu"] < 1
        assert numbers["host_syncs_per_step"] > 0  # the counter sees the loop's reads of the loss
        flops = numbers["flops_per_token"]
        # by hand: the tiny slice's head is 512 x 64, its 2 layers' experts 8 x 3 x 64 x 32 of which top-2 of 8 run
        assert flops["head"] == 6 * 512 * 64 and flops["experts"] == 6 * 2 * (8 * 3 * 64 * 32) * 2 / 8
        # each layer's attention (q and o 64 x 64, k and v 64 x 32, q/k norms), router (64 x 8) and 2 norms, and the
        # final norm; the input embedding is a lookup and counts nothing
        assert flops["layers"] == 6 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 32 + 64 * 8 + 2 * 64) + 64)
        assert flops["total"] == flops["head"] + flops["experts"] + flops["layers"]
        assert 0 < numbers["mfu_layers"] < numbers["mfu"]
        assert numbers["mfu"] == pytest.approx(flops["total"] * numbers["tokens_per_s"] / report["peak_flops_per_s"])
    assert is_number(report["peak_flops_per_s"]) and is_number(report["moeflow_over_hf_tokens_per_s"])
    assert report["shape"]["steps"] >= 2 and report["model"]["num_experts_per_tok"] == 2
    assert report["parts"]["benchmark"]["ok"] and report["total_seconds"] > 0
