"""Which fine-tuning method fits on which hardware: docs/training.md's table, from the memory planner.

For each model of ``config/models`` (and the embedded default) and each hardware of :data:`HARDWARE`, the methods
whose every phase fits (moeflow.plan.fit.fits) on exactly those devices, each with the cheapest layout that the
config check accepts on the current stack (moeflow.parallel.settings.training_layout_problems): ``none`` (the whole
model on each device), ``fsdp`` (FSDP2) or ``ep`` (transformers 5), and where none of those fits, ``offload``
(``parallel.cpu_offload``: FSDP2 with the states in the host memory of :data:`HOST_GIB`). Every job is bf16 with
activation checkpointing, micro-batch 1 and 2,048 tokens per sequence; LoRA is rank 16 on every target with the
router frozen (``train.lora``'s defaults), QLoRA the same over an NF4 base (``model.quantization: nf4``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from moeflow.model.settings import quantization_problems
from moeflow.parallel.settings import training_layout_problems
from moeflow.plan.counts import ParamCount, count_parameters
from moeflow.plan.fit import device_memory, fits, verdict
from moeflow.plan.fit import gib as to_gib
from moeflow.plan.memory import GIB, Job, PlanMemoryStage, host_per_node_bytes, phase_memory
from moeflow.plan.proposals import host_fits
from moeflow.plan.shapes import Shape
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import deep_merge

MODELS = {
    "embedded default": None,
    "Qwen3-30B-A3B": "qwen3-30b-a3b",
    "GPT-OSS-20B": "gpt-oss-20b",
    "Mixtral-8x7B": "mixtral-8x7b",
    "DeepSeek-V3": "deepseek-v3",
    "Step-3.5-Flash": "step3p5-flash",
}


HARDWARE = {
    "1 x 24 GiB": (1, 24),
    "1 x 80 GiB": (1, 80),
    "8 x 24 GiB": (8, 24),
    "8 x 80 GiB": (8, 80),
    "1 x 141 GiB": (1, 141),
}


# A node's host memory the table assumes for CPU offload: a workstation's beside one card, a server's beside eight.
HOST_GIB = {"1 x 24 GiB": 128, "1 x 80 GiB": 256, "8 x 24 GiB": 512, "8 x 80 GiB": 1024, "1 x 141 GiB": 256}


METHODS = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}  # QLoRA: LoRA over an NF4 base (model.quantization)


def job_overrides(devices: int, gib: int, method: str) -> dict[str, Any]:
    """The table's job on ``devices`` cards of ``gib``: the ``moe`` run only (the comparison runs dropped)."""
    quantization = "nf4" if method == "qlora" else "none"
    return {
        "model": {"quantization": quantization},
        "hardware": {"device": "cuda", "num_devices": devices, "memory_gib_per_device": gib},
        "parallel": {"nproc_per_node": devices, "nnodes": 1, "strategy": "none", "ep_size": 1, "fsdp_size": None},
        "precision": "bf16",
        "data": {"seq_len": 2048},
        "train": {
            "method": "lora" if method == "qlora" else method,
            "optimizer": "adamw",
            "micro_batch_size": 1,
            "gradient_checkpointing": True,
        },
        "runs": {"lora": None, "esft": None, "dense": None, "moe-seed2": None},
        "paper": {"dense_runs": [], "noise_run": None},
    }


def _settings(model: str | None, devices: int, gib: int, method: str) -> PlanMemoryStage:
    files = [REPO_ROOT / "config" / "models" / f"{model}.yaml"] if model else []
    cfg = run_config(load(*files, overrides=job_overrides(devices, gib, method)), "moe")
    return typed(PlanMemoryStage, plan_settings(cfg))


@functools.cache
def _counted(model: str | None) -> tuple[Shape, ParamCount]:
    settings = _settings(model, 1, 80, "full")
    shape, params, _ = count_parameters(settings.model, settings.vocab_size)
    return shape, params


def fitting_layouts(model: str | None, devices: int, gib: int, method: str, host_gib: int | None = None) -> list[str]:
    """The layouts in which ``method`` fits on the hardware, cheapest (fewest bytes moved) first; where none does,
    ``offload`` if CPU offload fits the devices and ``host_gib`` of host memory (None: not tried)."""
    shape, params = _counted(model)
    settings = _settings(model, devices, gib, method)
    memory, _ = device_memory(settings.hardware, {})
    job = Job.from_settings(settings)
    out = []
    for strategy in ("none", "fsdp", "ep") if devices > 1 else ("none",):
        ep_size = math.gcd(devices, shape.num_experts) if strategy == "ep" else 1
        if strategy == "ep" and (ep_size < 2 or not shape.moe_layers):
            continue
        if training_layout_problems(job.method, strategy, devices, shape.tie_word_embeddings, fsdp2=True):
            continue
        targets = tuple(job.lora.targets) if job.method == "lora" else ()
        if quantization_problems(job.quantization, job.method, job.gradient_checkpointing, targets):
            continue
        variant = dataclasses.replace(
            job, replicated=strategy == "none", expert_parallel=strategy == "ep", ep_size=ep_size, fsdp_size=None
        )
        if fits(shape, params, variant, memory):
            out.append(strategy)
    if out or host_gib is None or training_layout_problems(job.method, "fsdp", devices, fsdp2=True, cpu_offload=True):
        return out
    offloaded = dataclasses.replace(
        job, replicated=False, expert_parallel=False, ep_size=1, fsdp_size=None, cpu_offload=True
    )
    if fits(shape, params, offloaded, memory) and host_fits(shape, params, offloaded, host_gib * GIB):
        return ["offload"]
    return []


def method_table() -> str:
    """docs/training.md's table: per model and hardware, each method that fits and the layouts it fits in."""
    lines = ["| model | " + " | ".join(HARDWARE) + " |", "|---|" + "---|" * len(HARDWARE)]
    for name, model in MODELS.items():
        cells = []
        for hardware, (devices, gib) in HARDWARE.items():
            fitting = [
                f"{label} ({', '.join(layouts)})"
                for method, label in METHODS.items()
                if (layouts := fitting_layouts(model, devices, gib, method, HOST_GIB[hardware]))
            ]
            cells.append("; ".join(fitting) or "no")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Target:
    """A row of #38's target table: a model's fine-tune on some hardware, and the per-device plan it must reach."""

    model: str  # a config/models name
    method: str  # lora | qlora
    devices: int
    gib: int
    seq_len: int
    strategy: str
    goal_gib: float | None  # None: it must fit


TARGETS = (
    Target("qwen3-30b-a3b", "qlora", 1, 24, 2048, "none", 20),
    Target("gpt-oss-20b", "qlora", 1, 24, 2048, "none", 16),
    Target("qwen3-30b-a3b", "lora", 2, 80, 4096, "fsdp", None),
    Target("step3p5-flash", "lora", 8, 80, 4096, "ep", None),
    Target("step3p5-flash", "qlora", 1, 141, 4096, "none", None),
    Target("step3p5-flash", "qlora", 8, 24, 2048, "fsdp", None),
)


def target_plan(target: Target, targets: tuple[str, ...] = ("all",), cpu_offload: bool = False) -> dict[str, Any]:
    """The plan of a target row with LoRA on ``targets`` (rank 16, router frozen), in its layout or under CPU
    offload (FSDP2 over its devices): its worst phase's GiB per device, the verdict, and a node's host memory in
    its worst phase."""
    layout = {"strategy": "fsdp", "cpu_offload": True} if cpu_offload else {"strategy": target.strategy}
    if layout["strategy"] == "ep":
        layout["ep_size"] = target.devices
    overrides = deep_merge(
        job_overrides(target.devices, target.gib, target.method),
        {
            "data": {"seq_len": target.seq_len},
            "parallel": layout,
            "train": {"lora": {"targets": list(targets)}, "mtp": {"mode": "frozen"}},
        },
    )
    cfg = run_config(load(REPO_ROOT / "config" / "models" / f"{target.model}.yaml", overrides=overrides), "moe")
    settings = typed(PlanMemoryStage, plan_settings(cfg))
    shape, params = _counted(target.model)
    job = Job.from_settings(settings)
    phases = phase_memory(shape, params, job)
    worst = max(phases, key=lambda phase: phases[phase]["device"]["total"])
    total = phases[worst]["device"]["total"]
    host = max(host_per_node_bytes(phase, job) for phase in phases.values())
    return {
        "gib": to_gib(total),
        "phase": worst,
        "verdict": verdict(total, device_memory(settings.hardware, {})[0]),
        "host_gib": to_gib(host),
    }


def target_table() -> str:
    """docs/training.md's target rows: each row's plan per device with LoRA on every target, and without adapters on
    the routed experts (attention, dense and shared MLPs), against its goal."""
    lines = [
        "| model | method | hardware | seq | layout | goal | all targets | without routed experts "
        "| all targets, cpu_offload (host per node) |",
        "|---|---|---|---:|---|---|---|---|---|",
    ]
    for t in TARGETS:
        cells = []
        for targets in (("all",), ("attention", "dense_ffn", "shared_experts")):
            p = target_plan(t, targets)
            cells.append(f"{p['gib']:.1f} GiB ({p['phase']}): {p['verdict'].replace('_', ' ')}")
        p = target_plan(t, cpu_offload=True)
        cells.append(f"{p['gib']:.1f} GiB ({p['phase']}): {p['verdict'].replace('_', ' ')} ({p['host_gib']:.0f} GiB)")
        goal = f"<= {t.goal_gib:g} GiB" if t.goal_gib else "fits"
        method = {"lora": "LoRA bf16", "qlora": "QLoRA nf4"}[t.method]
        lines.append(
            f"| {t.model} | {method} | {t.devices} x {t.gib} GiB | {t.seq_len} | {t.strategy} | {goal} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"
