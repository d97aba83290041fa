"""Whether a job's phases fit, and the smallest device count at which every phase does.

Each phase of moeflow.plan.memory's per-rank memory is set against one device's memory and a node's host memory.

The device's memory is ``hardware.memory_gib_per_device``, on CUDA as torch sees a card of that nominal
size (``VISIBLE_GIB``: 79.11 GiB of an 80 GB H100), or what verify_env measured (torch's total).

Host memory per node (``plan()["host"]``): ``parallel.nproc_per_node`` ranks x a rank's host side in each
phase (on CPU, x its whole figure), the worst phase against the training job's ``mem_mb`` when the caller
knows it, else this machine's RAM (binding only when the ranks run here, on CPU).

A phase *fits* when its device total is at most ``1 - HEADROOM`` of the device memory, is *tight* up to
the full memory (a warning), and *does not fit* above it. ``plan()["phases"]`` has every phase, the
verdict is the worst phase's (``plan()["worst_phase"]``, the largest device total): moeflow.plan.report.enforce raises
naming the phases that do not fit with their terms, and the configurations that would (moeflow.plan.proposals).
``plan()`` is moeflow.plan.training_plan's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from moeflow.plan.counts import ParamCount
from moeflow.plan.memory import (
    GIB,
    Job,
    host_per_node_bytes,
    memory_per_device,
    muon_gathered_bytes,
    rank_bytes,
    worst_device_total,
)
from moeflow.plan.shapes import PlanError, Shape
from moeflow.runtime.env import device_memory_bytes

HEADROOM = 0.10


# What torch.cuda reports as a card's total memory, by the nominal size configs and profiles name
# (hardware.memory_gib_per_device): "GPU 0 has a total capacity of 79.11 GiB" on an H100 80GB.
VISIBLE_GIB = {80: 79.11, 24: 23.68}  # H100 / A100 80GB; RTX 4090


def verdict(total: int, memory: int) -> str:
    if total <= (1 - HEADROOM) * memory:
        return "fits"
    return "tight" if total <= memory else "does_not_fit"


def device_memory(hardware: Mapping[str, Any], env_report: Mapping[str, Any]) -> tuple[int, str]:
    """One device's memory: the config's ``hardware.memory_gib_per_device`` (on CUDA what torch sees of a card of
    that nominal size, ``VISIBLE_GIB``), else measured by verify_env (torch's total)."""
    nominal = hardware["memory_gib_per_device"]
    if nominal and hardware["device"] == "cuda" and nominal in VISIBLE_GIB:
        return (
            int(VISIBLE_GIB[nominal] * GIB),
            f"hardware.memory_gib_per_device: {nominal:g}, {VISIBLE_GIB[nominal]} GiB visible to torch",
        )
    if nominal:
        return int(nominal * GIB), "hardware.memory_gib_per_device"
    measured, source = device_memory_bytes(env_report, hardware["device"])
    if measured is None:
        raise PlanError(
            f"hardware.device is {hardware['device']!r} but {source}: set hardware.memory_gib_per_device to plan "
            "for a machine you do not have, or hardware.device: cpu"
        )
    if hardware["device"] == "cpu" and hardware["num_devices"] > 1:
        return measured // hardware["num_devices"], f"{source}, shared by {hardware['num_devices']} CPU ranks"
    return measured, source


def fits(s: Shape, params: ParamCount, job: Job, memory: int) -> bool:
    """Whether every phase of the job fits on its devices with headroom."""
    return verdict(worst_device_total(s, params, job), memory) == "fits"


STEPS_UP = 64  # device counts tried one by one past the step's estimate before halving the rest of the range


def min_devices(s: Shape, params: ParamCount, job: Job, memory: int, limit: int = 1_000_000) -> int | None:
    """The smallest device count at which every phase of the job fits with headroom, or None if no count
    does. More devices help by sharding: a ``strategy: none`` job is counted as FSDP over them."""
    job = dataclasses.replace(job, replicated=False, fsdp_size=None)
    if fits(s, params, dataclasses.replace(job, num_devices=1), memory):
        return 1
    # the step's sharded states give the first count to try (no phase fits before the step does)
    two = dataclasses.replace(job, num_devices=2)
    at_two = memory_per_device(s, params, two)
    # (the optimizer term holds Muon's whole gathered parameter, which sharding does not shrink; under CPU offload the
    # states are the host's, and more devices shrink little on each)
    states = sum(at_two.get(term, 0) for term in ("weights", "gradients", "optimizer"))
    sharded = 2 * (states - muon_gathered_bytes(params, two)) if states else 0
    replicated = at_two["total"] - sharded / 2
    room = (1 - HEADROOM) * memory - replicated
    if room <= 0:
        return None
    if not sharded:  # CPU offload: more devices shrink only each unit's copies; a node's worth is the last to try
        return next((n for n in range(2, 9) if fits(s, params, dataclasses.replace(job, num_devices=n), memory)), None)
    first = max(2, math.ceil(sharded / room))
    tried = range(first, min(first + STEPS_UP, limit + 1))
    for n in tried:  # ceil() of the shards, or another phase, can need a few more: step up until it really fits
        if fits(s, params, dataclasses.replace(job, num_devices=n), memory):
            return n
    # a term of another phase that sharding does not shrink (a quantized load's read buffer) may fit at no count
    if tried.stop > limit or not fits(s, params, dataclasses.replace(job, num_devices=limit), memory):
        return None
    low, high = tried.stop, limit
    while low < high:  # the fewest devices that fit, halving the range: more devices never hold more each
        middle = (low + high) // 2
        if fits(s, params, dataclasses.replace(job, num_devices=middle), memory):
            high = middle
        else:
            low = middle + 1
    return high


def gib(n: float) -> float:
    return round(n / GIB, 2)


MEM_MB_SOURCE = "the training job's mem_mb"


def host_limit(env_report: Mapping[str, Any], mem_mb: int | None) -> tuple[int, str]:
    """A node's host memory: the training job's ``mem_mb`` (SLURM megabytes: MiB) when known, else this
    machine's RAM (verify_env report)."""
    if mem_mb:
        return int(mem_mb) * 2**20, MEM_MB_SOURCE
    return device_memory_bytes(env_report, "cpu")


def phase_plans(
    phases: Mapping[str, Mapping[str, Mapping[str, int]]], job: Job, memory: int, host_limit_bytes: int
) -> dict[str, dict[str, Any]]:
    """Each phase of :func:`phase_memory` with its sizes in GiB, its node's host memory and both verdicts."""
    out = {}
    for name, phase in phases.items():
        per_node = host_per_node_bytes(phase, job)
        out[name] = {
            "device_bytes": dict(phase["device"]),
            "host_bytes": dict(phase["host"]),
            "device_gib": {k: gib(v) for k, v in phase["device"].items()},
            "host_gib": {k: gib(v) for k, v in phase["host"].items()},
            "rank_bytes": rank_bytes(phase),
            "host_per_node_bytes": per_node,
            "verdict": verdict(phase["device"]["total"], memory),
            "host_verdict": verdict(per_node, host_limit_bytes),
        }
    return out


def worst_phase(phases: Mapping[str, Mapping[str, Any]], key: str) -> str:
    """The phase with the most of ``key`` (``device_bytes``' total, or ``host_per_node_bytes``); the earliest
    on a tie."""
    size = lambda name: phases[name][key]["total"] if key == "device_bytes" else phases[name][key]  # noqa: E731
    return max(phases, key=size)


def host_plan(phases: Mapping[str, Mapping[str, Any]], job: Job, limit: int, source: str) -> dict[str, Any]:
    """A node's host memory in its worst phase against ``limit``."""
    worst = worst_phase(phases, "host_per_node_bytes")
    return {
        "phase": worst,
        "ranks_per_node": job.ranks_per_node,
        "per_node_bytes": {name: phase["host_per_node_bytes"] for name, phase in phases.items()},
        "per_node_gib": {name: gib(phase["host_per_node_bytes"]) for name, phase in phases.items()},
        "limit_bytes": limit,
        "limit_source": source,
        "verdict": phases[worst]["host_verdict"],
    }
