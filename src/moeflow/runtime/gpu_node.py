"""Checks of a GPU node for verify_env: the NVIDIA driver, the GPU count against the layout, an NCCL all-reduce.

Facts only, the same on every run of a healthy node (no timings). On a machine without GPUs each check
says why it was skipped. Problems (fewer GPUs than ``parallel.nproc_per_node`` with ``hardware.device:
cuda``, a failed all-reduce) fail verify_env with ``env.strict`` and are warnings otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("moeflow.runtime.gpu_node")


NVML_LIBRARY = "libnvidia-ml.so.1"


ALL_REDUCE_TIMEOUT_S = 120


# One process per GPU, each all-reduces a 1 on its GPU over NCCL; the sum must be the GPU count. A module run
# with -m (not a -c program): torch.multiprocessing.spawn's children import the worker by its module's name.
ALL_REDUCE_PROBE = "moeflow.runtime.all_reduce_probe"


def probe_command(backend: str = "nccl", world: int | None = None) -> list[str]:
    """The probe's command line (``--backend gloo --world N`` runs the same code on CPU processes)."""
    return [sys.executable, "-m", ALL_REDUCE_PROBE, "--backend", backend] + (
        [] if world is None else ["--world", str(world)]
    )


def probe_env() -> dict[str, str]:
    """This environment with the moeflow package this process imports first on PYTHONPATH."""
    src = str(Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, *rest])}


class NodeProblem(RuntimeError):
    """Strict verification found a GPU node that cannot run the configured layout."""


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version from NVML (``libnvidia-ml.so.1``, which the driver installs), or None."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):  # no driver here, or an NVML without the v2 entry points
        return None
    try:
        buffer = ctypes.create_string_buffer(96)
        return buffer.value.decode() if nvml.nvmlSystemGetDriverVersion(buffer, len(buffer)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def all_reduce_check(gpus: int, backend: str = "nccl") -> dict[str, Any]:
    """A tiny all-reduce over the node's GPUs (NCCL), in a subprocess with a timeout (a broken NCCL hangs).
    ``backend="gloo"`` runs the same probe over ``gpus`` CPU processes (the unit test's stand-in)."""
    what = f"{backend.upper()} all-reduce over {gpus} {'GPU(s)' if backend == 'nccl' else 'process(es)'}"
    if gpus == 0:
        return {"ran": False, "ok": None, "reason": "no CUDA GPU here: no NCCL all-reduce to try"}
    try:
        proc = subprocess.run(
            probe_command(backend, gpus),
            capture_output=True,
            env=probe_env(),
            text=True,
            timeout=ALL_REDUCE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"ran": True, "ok": False, "reason": f"{what} hung: killed after {ALL_REDUCE_TIMEOUT_S} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"ran": True, "ok": False, "reason": f"{what} failed: {tail[0]}"}
    return {"ran": True, "ok": True, "reason": f"{what}: the sum is right"}


def layout(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`check` compares the node with (verify_env's params): ``hardware.device`` and, on CUDA only,
    ``parallel.nproc_per_node`` (with CPU ranks it is not checked: changing it must not rerun verify_env)."""
    device = cfg["hardware"]["device"]
    return {"device": device, "nproc_per_node": cfg["parallel"]["nproc_per_node"] if device == "cuda" else None}


def check(layout: Mapping[str, Any]) -> dict[str, Any]:
    """The node report for a :func:`layout`."""
    gpus = gpu_count()
    problems = []
    if layout["device"] == "cuda" and gpus != layout["nproc_per_node"]:
        problems.append(
            f"torch sees {gpus} GPU(s) on this node, but config key 'parallel.nproc_per_node' asks for "
            f"{layout['nproc_per_node']} ranks on it (hardware.device: cuda): give verify_env the whole node "
            "(the profile's set-resources verify_env: gpu) or make parallel.nproc_per_node the node's GPU count"
        )
    all_reduce = all_reduce_check(gpus)
    if all_reduce["ok"] is False:
        problems.append(all_reduce["reason"])
    driver = nvidia_driver_version()
    return {
        "nvidia_driver": driver
        or ("unknown: NVML (libnvidia-ml.so.1) did not answer" if gpus else "none: no NVIDIA driver here"),
        "gpus": gpus,
        "layout": {"device": layout["device"], "nproc_per_node": layout["nproc_per_node"]},
        "gpu_count_matches": None if layout["device"] != "cuda" else gpus == layout["nproc_per_node"],
        "all_reduce": all_reduce,
        "problems": problems,
    }


def enforce(node: Mapping[str, Any], strict: bool) -> list[str]:
    """``env.strict``: raise listing the node's problems; otherwise log and return them as warnings."""
    if node["problems"] and strict:
        listing = "\n".join(f"  - {p}" for p in node["problems"])
        raise NodeProblem(f"this GPU node cannot run the configured layout:\n{listing}\n(env.strict is true)")
    for problem in node["problems"]:
        log.warning("GPU node: %s", problem)
    return list(node["problems"])


def render_markdown(node: Mapping[str, Any]) -> str:
    match = {None: "not checked (hardware.device: cpu)", True: "yes", False: "no"}[node["gpu_count_matches"]]
    lines = [
        "## GPU node",
        "",
        "| fact | value |",
        "|---|---|",
        f"| NVIDIA driver | {node['nvidia_driver']} |",
        f"| GPUs | {node['gpus']} (parallel.nproc_per_node {node['layout']['nproc_per_node']}: {match}) |",
        f"| NCCL all-reduce | {node['all_reduce']['reason']} |",
    ]
    lines += ["", *(f"- problem: {p}" for p in node["problems"])] if node["problems"] else []
    return "\n".join(lines) + "\n"
