"""verify_env's GPU-node checks with NVML, torch.cuda and the NCCL probe faked: a healthy 8-GPU node, a node
with fewer GPUs than parallel.nproc_per_node, a broken all-reduce, and a CPU machine."""

from __future__ import annotations

import subprocess

import pytest
import torch

from moeflow.runtime import gpu_node

CUDA_LAYOUT = {"device": "cuda", "nproc_per_node": 8}


class FakeNvml:
    """libnvidia-ml.so.1's three calls verify_env makes."""

    def nvmlInit_v2(self):
        return 0

    def nvmlSystemGetDriverVersion(self, buffer, length):
        buffer.value = b"550.54.15"
        return 0

    def nvmlShutdown(self):
        return 0


def fake_node(monkeypatch, gpus: int, probe=None):
    """A node with ``gpus`` GPUs; ``probe``: what the all-reduce subprocess does (default: succeeds)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(
        gpu_node.ctypes, "CDLL", lambda name: FakeNvml() if gpus else (_ for _ in ()).throw(OSError(name))
    )
    probes = []

    def run(cmd, **kwargs):
        probes.append(cmd)
        if probe is not None:
            return probe(cmd, **kwargs)
        return subprocess.CompletedProcess(cmd, 0, stdout=f"all-reduce over {gpus} GPU(s): ok\n", stderr="")

    monkeypatch.setattr(gpu_node.subprocess, "run", run)
    return probes


def test_a_healthy_eight_gpu_node_passes_strict_verification(monkeypatch):
    probes = fake_node(monkeypatch, 8)
    node = gpu_node.check(CUDA_LAYOUT)
    assert node["nvidia_driver"] == "550.54.15" and node["gpus"] == 8 and node["gpu_count_matches"]
    assert node["all_reduce"]["ok"] and node["problems"] == []
    assert len(probes) == 1 and probes[0][1:3] == ["-m", gpu_node.ALL_REDUCE_PROBE]  # in a subprocess
    assert gpu_node.enforce(node, strict=True) == []
    assert "550.54.15" in gpu_node.render_markdown(node)


def test_fewer_gpus_than_nproc_per_node_fails_strict_and_warns_otherwise(monkeypatch, caplog):
    fake_node(monkeypatch, 4)
    node = gpu_node.check(CUDA_LAYOUT)
    assert node["gpu_count_matches"] is False and len(node["problems"]) == 1
    assert (
        "torch sees 4 GPU(s)" in node["problems"][0] and "'parallel.nproc_per_node' asks for 8" in node["problems"][0]
    )
    with pytest.raises(gpu_node.NodeProblem, match="torch sees 4 GPU"):
        gpu_node.enforce(node, strict=True)
    assert gpu_node.enforce(node, strict=False) == node["problems"]
    assert "torch sees 4 GPU(s)" in caplog.text


@pytest.mark.parametrize("failure", ["error", "hang"])
def test_a_broken_all_reduce_is_a_problem(monkeypatch, failure):
    def probe(cmd, **kwargs):
        if failure == "hang":
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        return subprocess.CompletedProcess(
            cmd, 1, stdout="", stderr="...\ntorch.distributed.DistBackendError: NCCL error"
        )

    fake_node(monkeypatch, 8, probe)
    node = gpu_node.check(CUDA_LAYOUT)
    assert node["gpu_count_matches"] and node["all_reduce"] == {
        "ran": True,
        "ok": False,
        "reason": node["all_reduce"]["reason"],
    }
    assert ("NCCL error" if failure == "error" else "hung") in node["all_reduce"]["reason"]
    with pytest.raises(gpu_node.NodeProblem, match="NCCL all-reduce over 8 GPU"):
        gpu_node.enforce(node, strict=True)


def test_a_cpu_machine_skips_the_gpu_checks_with_the_reason(monkeypatch):
    probes = fake_node(monkeypatch, 0)
    node = gpu_node.check({"device": "cpu", "nproc_per_node": None})
    assert node["gpus"] == 0 and node["gpu_count_matches"] is None and node["problems"] == []
    assert node["nvidia_driver"].startswith("none") and probes == []
    assert node["all_reduce"] == {"ran": False, "ok": None, "reason": "no CUDA GPU here: no NCCL all-reduce to try"}
    assert gpu_node.enforce(node, strict=True) == []


def test_a_cuda_config_on_a_cpu_machine_is_reported():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    node = gpu_node.check(CUDA_LAYOUT)  # the real NVML and torch.cuda of this machine
    assert node["gpus"] == 0 and node["problems"] and node["all_reduce"]["ran"] is False


def test_the_layout_names_nproc_per_node_on_cuda_only():
    """CPU ranks are not checked: a change of their number must not rerun verify_env."""
    cfg = {"hardware": {"device": "cpu"}, "parallel": {"nproc_per_node": 2}}
    assert gpu_node.layout(cfg) == {"device": "cpu", "nproc_per_node": None}
    cfg["hardware"]["device"] = "cuda"
    assert gpu_node.layout(cfg) == {"device": "cuda", "nproc_per_node": 2}


def test_the_probe_runs_under_spawn_on_two_gloo_processes():
    """The real probe subprocess, with gloo in place of NCCL: torch.multiprocessing.spawn's children must be able
    to import the worker (a function of a ``python -c`` program cannot be unpickled in a spawned child)."""
    result = gpu_node.all_reduce_check(2, backend="gloo")
    assert result == {"ran": True, "ok": True, "reason": "GLOO all-reduce over 2 process(es): the sum is right"}
