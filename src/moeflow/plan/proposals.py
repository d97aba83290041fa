"""What the planner proposes: the cheapest configurations of a run that fit, each as a config overlay.

:func:`proposals` searches method (the run's; a full fine-tune is offered LoRA too) x layout (``none`` on the run's
devices; ``fsdp`` and, on transformers 5, ``ep`` on as few devices as fit; ``fsdp`` with ``cpu_offload`` on as few
as fit where a node's host memory holds the states) x activation checkpointing x micro-batch. It keeps the
combinations whose every phase fits (moeflow.plan.fit.fits) and that the config check
accepts: the layouts of moeflow.parallel.settings.training_layout_problems, and with a change of method the keys it
brings along (LoRA trains with AdamW and leaves the MTP layers frozen). They are ranked by devices, then the step's
FLOPs per token, then the bytes each device moves per micro-batch. A proposal's ``overlay`` holds the keys it
changes and no other, as YAML a user passes with ``--configfile`` after the run's own config.

The costs rank the proposals; they are estimates, not timings. FLOPs per token: 6 x the active parameters for a
full fine-tune, 4 x for LoRA (the frozen weights get no gradient), 2 x more with activation checkpointing (the
forward again). Bytes moved per micro-batch and device: FSDP's all-gather of the weights in the forward and the
backward and reduce-scatter of the trained gradients in fp32; expert parallelism gathers the weights but the
routed experts, whose tokens go to them and back (all-to-all, forward and backward); ``none`` on several ranks
all-reduces the trained gradients (once per step, counted per micro-batch at the run's micro-batches per step
of one); CPU offload adds each device's share of the weights copied in twice and of the gradients copied out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from moeflow.model.settings import quantization_problems
from moeflow.parallel.settings import training_layout_problems
from moeflow.plan.activations import FP32_BYTES, WEIGHT_BYTES
from moeflow.plan.counts import ParamCount
from moeflow.plan.fit import fits, gib, min_devices, verdict
from moeflow.plan.memory import (
    Job,
    PlanMemoryStage,
    host_per_node_bytes,
    phase_memory,
    trained_parameters,
    worst_device_total,
)
from moeflow.plan.shapes import Shape
from moeflow.runtime import compat

# Devices of one node where the run names no more (``parallel.nproc_per_node``): a proposal of more devices spans
# whole nodes of this many.
NODE_DEVICES = 8


# How many proposals plan.json and the report keep, cheapest first.
KEPT = 6


def proposals(
    s: Shape,
    params: ParamCount,
    job: Job,
    memory: int,
    settings: PlanMemoryStage,
    host_limit: int | None = None,
    kept: int = KEPT,
) -> list[dict[str, Any]]:
    """The cheapest configurations that fit (module docstring), each ``{"change", "overlay", "num_devices",
    "per_device_gib", "worst_phase_gib", "step_flops_per_token", "bytes_moved_per_micro_batch"}``; ``settings``
    are the plan's, against which an overlay names only what changes. ``host_limit``: a node's host memory, which
    a CPU-offload proposal must fit in (None: none is proposed)."""
    found: dict[str, dict[str, Any]] = {}
    methods = [job.method] + (["lora"] if job.method == "full" else [])
    for method, quantization in [(m, q) for m in methods for q in _quantizations(job, m)]:
        for checkpointing in sorted({job.gradient_checkpointing, True}):
            for micro_batch in sorted({job.micro_batch_size, 1}):
                base = dataclasses.replace(
                    job,
                    method=method,
                    quantization=quantization,
                    gradient_checkpointing=checkpointing,
                    micro_batch_size=micro_batch,
                )
                for strategy in ("none", "fsdp", "ep", "cpu_offload"):
                    variant = _smallest_layout(s, params, base, memory, strategy, host_limit)
                    if variant is None or _refused(s, variant):
                        continue
                    change = overlay(job, variant, settings)
                    if change:  # the run as it is is no proposal
                        found.setdefault(_label(change), _proposal(s, params, variant, change))
    ranked = sorted(
        found.values(), key=lambda p: (p["num_devices"], p["step_flops_per_token"], p["bytes_moved_per_micro_batch"])
    )
    return ranked[:kept]


def fewest_devices(s: Shape, params: ParamCount, job: Job, memory: int) -> int | None:
    """The smallest device count at which the job fits in a layout its method can run: sharded (moeflow.plan.fit's
    ``min_devices``), or for a method that runs on whole models only (LoRA) one device or none."""
    if training_layout_problems(job.method, "fsdp", 2):
        alone = dataclasses.replace(job, num_devices=1, replicated=False, expert_parallel=False, fsdp_size=None)
        return 1 if fits(s, params, alone, memory) else None
    return min_devices(s, params, job, memory)


def _smallest_layout(
    s: Shape, params: ParamCount, job: Job, memory: int, strategy: str, host_limit: int | None = None
) -> Job | None:
    """``job`` in ``strategy`` on the fewest devices at which it fits (``none``: on the run's own devices;
    ``cpu_offload``: FSDP2 with its state on the host, whose every phase must fit in ``host_limit`` per node), or
    None."""
    if strategy == "cpu_offload":
        return _smallest_offload(s, params, job, memory, host_limit)
    job = dataclasses.replace(job, cpu_offload=False)
    if strategy == "none":
        variant = dataclasses.replace(
            job, expert_parallel=False, replicated=job.num_devices > 1, fsdp_size=None, ep_size=1
        )
        return variant if fits(s, params, variant, memory) else None
    if strategy == "ep" and not (s.moe_layers and compat.is_transformers_v5()):  # transformers 5's expert parallelism
        return None
    sharded = dataclasses.replace(job, expert_parallel=strategy == "ep", replicated=False, fsdp_size=None, ep_size=1)
    first = min_devices(s, params, sharded, memory)
    if first is None:
        return None
    first = max(2, first)
    for devices in range(first, 4 * first + NODE_DEVICES):
        devices = _whole_nodes(devices, job)
        ep_size = _ep_size(devices, s.num_experts) if strategy == "ep" else 1
        if strategy == "ep" and ep_size < 2:
            continue
        variant = dataclasses.replace(sharded, num_devices=devices, ep_size=ep_size)
        if fits(s, params, variant, memory):
            return variant
    return None


def _smallest_offload(s: Shape, params: ParamCount, job: Job, memory: int, host_limit: int | None) -> Job | None:
    if host_limit is None or job.device != "cuda":  # on the CPU, offload to the host moves nothing
        return None
    offloaded = dataclasses.replace(
        job, cpu_offload=True, expert_parallel=False, replicated=False, fsdp_size=None, ep_size=1
    )
    for devices in range(1, 2 * NODE_DEVICES + 1):
        devices = _whole_nodes(devices, job)
        variant = dataclasses.replace(offloaded, num_devices=devices, ranks_per_node=min(devices, _per_node(job)))
        if fits(s, params, variant, memory) and host_fits(s, params, variant, host_limit):
            return variant
    return None


def host_fits(s: Shape, params: ParamCount, job: Job, host_limit: int) -> bool:
    """Whether a node's ranks fit in ``host_limit`` with headroom in every phase."""
    per_node = max(host_per_node_bytes(phase, job) for phase in phase_memory(s, params, job).values())
    return verdict(per_node, host_limit) == "fits"


def _per_node(job: Job) -> int:
    return job.ranks_per_node if job.ranks_per_node > 1 else NODE_DEVICES


def _whole_nodes(devices: int, job: Job) -> int:
    per_node = _per_node(job)
    return devices if devices <= per_node else per_node * math.ceil(devices / per_node)


def _ep_size(devices: int, experts: int) -> int:
    """The largest count of the ranks that divides both the ranks and the experts (transformers splits a layer's
    experts evenly over ``ep_size`` ranks, which divide the FSDP ranks)."""
    return math.gcd(devices, experts)


def _quantizations(job: Job, method: str) -> list[str]:
    """The run's quantization, and for LoRA a 4-bit base (QLoRA) too."""
    return sorted({job.quantization if method == job.method else "none", *(["nf4"] if method == "lora" else [])})


def _refused(s: Shape, job: Job) -> bool:
    return bool(
        training_layout_problems(
            job.method,
            job.strategy,
            job.num_devices,
            s.tie_word_embeddings,
            s.model_type,
            cpu_offload=job.cpu_offload,
            lora_router=job.lora.router if job.method == "lora" else "frozen",
            lora_targets=tuple(job.lora.targets) if job.method == "lora" else (),
        )
        or quantization_problems(
            job.quantization,
            job.method,
            job.gradient_checkpointing,
            tuple(job.lora.targets) if job.method == "lora" else (),
        )
    )


def overlay(job: Job, variant: Job, settings: PlanMemoryStage) -> dict[str, dict[str, Any]]:
    """The config keys that turn the run of ``settings`` (whose job is ``job``) into ``variant``, and no other."""
    train, parallel, hardware = settings.train, settings.parallel, settings.hardware
    wanted: dict[str, dict[str, Any]] = {
        "train": {
            "method": variant.method,
            "gradient_checkpointing": variant.gradient_checkpointing,
            "micro_batch_size": variant.micro_batch_size,
        }
    }
    if variant.quantization != job.quantization:
        wanted["model"] = {"quantization": variant.quantization}
    if variant.method == "lora":  # what the config check asks of a LoRA run: AdamW, MTP layers frozen
        wanted["train"]["optimizer"] = "adamw"
        if job.mtp_trained:
            wanted["train"]["mtp"] = {"mode": "frozen"}
    layout = lambda j: (j.strategy, j.num_devices, j.ep_size, j.cpu_offload)  # noqa: E731
    if layout(variant) != layout(job):
        per_node = min(variant.num_devices, _per_node(job))
        wanted["parallel"] = {
            "strategy": variant.strategy,
            "nproc_per_node": per_node,
            "nnodes": variant.num_devices // per_node,
            "ep_size": variant.ep_size,
            "fsdp_size": None,
            "cpu_offload": variant.cpu_offload,
        }
        wanted["hardware"] = {"num_devices": variant.num_devices}
    current = {"train": train, "parallel": parallel, "hardware": hardware, "model": settings.model}
    out: dict[str, dict[str, Any]] = {}
    for section, keys in wanted.items():
        for key, value in keys.items():
            if isinstance(value, dict):
                changed = {k: v for k, v in value.items() if (current[section].get(key) or {}).get(k) != v}
                if changed:
                    out.setdefault(section, {})[key] = changed
            elif current[section].get(key) != value:
                out.setdefault(section, {})[key] = value
    return out


def _label(change: Mapping[str, Mapping[str, Any]]) -> str:
    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, Mapping):
            return [item for k, v in value.items() for item in flat(f"{prefix}.{k}", v)]
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        return [f"{prefix}: {text}"]

    return ", ".join(item for section, keys in change.items() for item in flat(section, keys))


def _proposal(s: Shape, params: ParamCount, job: Job, change: dict[str, Any]) -> dict[str, Any]:
    return {
        "change": _label(change),
        "overlay": change,
        "num_devices": job.num_devices,
        "strategy": job.strategy,
        "per_device_gib": gib(worst_device_total(s, params, job)),
        "step_flops_per_token": step_flops_per_token(params, job),
        "bytes_moved_per_micro_batch": bytes_moved_per_micro_batch(s, params, job),
    }


def step_flops_per_token(params: ParamCount, job: Job) -> int:
    """The training step's FLOPs per token (module docstring): forward 2, backward 4 (2 for frozen weights, which
    get no gradient of their own), the forward again under activation checkpointing."""
    backward = 2 if job.method == "lora" else 4
    return (2 + backward + (2 if job.gradient_checkpointing else 0)) * params.active


def bytes_moved_per_micro_batch(s: Shape, params: ParamCount, job: Job) -> int:
    """What one device sends and receives per micro-batch (module docstring): an estimate that ranks layouts."""
    n = job.num_devices
    _, trained = trained_parameters(s, params, job)
    width = WEIGHT_BYTES[job.precision]
    # CPU offload: each unit's shards go to the device in the forward and again in the backward, the gradients'
    # to the host (over PCIe)
    offload = round((2 * params.total * width + trained * FP32_BYTES) / n) if job.cpu_offload else 0
    if n == 1:
        return offload
    share = (n - 1) / n
    if job.strategy == "none":
        return round(2 * share * trained * FP32_BYTES)
    moved = 2 * share * params.total * width + share * trained * FP32_BYTES
    if job.strategy == "ep":
        # a rank's experts are gathered over the ranks that hold the same ones (n / ep_size), not over all n
        experts = params.by_category.get("routed_experts", 0)
        ep = job.expert_ranks
        holders = max(1, n // ep)
        moved += 2 * (experts / ep) * width * (holders - 1) / holders - 2 * share * experts * width
        tokens = job.micro_batch_size * job.seq_len
        moved += 4 * (ep - 1) / ep * tokens * s.top_k * s.hidden_size * width * len(s.moe_layers)
    return round(max(moved, 0)) + offload
