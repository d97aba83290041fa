"""The plan of one training run: rule plan_memory's plan.json.

Its parameters, the memory of every phase per rank against its devices and a node's host memory, the verdict, and
the cheapest configurations that fit (moeflow.plan.proposals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moeflow.plan.counts import count_parameters, lora_count
from moeflow.plan.fit import HEADROOM, device_memory, gib, host_limit, host_plan, phase_plans, worst_phase
from moeflow.plan.memory import Job, PlanMemoryStage, phase_memory
from moeflow.plan.proposals import fewest_devices, proposals


def plan(settings: PlanMemoryStage, env_report: Mapping[str, Any], mem_mb: int | None = None) -> dict[str, Any]:
    """The full plan for one run: parameters, memory per rank in every phase, the worst phase and its verdict, the
    cheapest configurations that fit (moeflow.plan.proposals), and a node's host memory (against ``mem_mb``, the
    training job's, when given). ``per_device_bytes`` is the step's."""
    shape, params, formula = count_parameters(settings.model, settings.vocab_size)
    job = Job.from_settings(settings)
    memory, source = device_memory(settings.hardware, env_report)
    limit, limit_source = host_limit(env_report, mem_mb)
    phases = phase_plans(phase_memory(shape, params, job), job, memory, limit)
    worst = worst_phase(phases, "device_bytes")
    result = phases[worst]["verdict"]
    per_device = phases["step"]["device_bytes"]
    out = {
        "model_type": shape.model_type,
        "shape": dataclasses.asdict(shape)
        | {"moe_layers": list(shape.moe_layers), "dense_layers": list(shape.dense_layers)},
        "parameters": params.as_dict()
        | {"formula_total": formula.total, "formula_matches": formula.total == params.total},
        "job": job.as_dict(),
        "device_memory_bytes": memory,
        "device_memory_source": source,
        "per_device_bytes": per_device,
        "per_device_gib": {k: gib(v) for k, v in per_device.items()},
        "phases": phases,
        "worst_phase": worst,
        "usable_fraction": 1 - HEADROOM,
        "verdict": result,
        "min_devices": fewest_devices(shape, params, job, memory),
        "suggestions": proposals(shape, params, job, memory, settings, limit),
        "host": host_plan(phases, job, limit, limit_source),
    }
    if job.method == "lora":
        out["lora"] = {**job.lora.as_dict(), **lora_count(shape, job.lora).as_dict()}
    return out
