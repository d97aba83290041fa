"""Which fine-tuning method fits on which hardware: docs/training.md's table, from the memory planner.

For each model of ``config/models`` (and the embedded default) and each hardware of :data:`HARDWARE`, the methods
whose every phase fits (moeflow.plan.fit.fits) on exactly those devices, each with the cheapest layout that the
config check accepts (moeflow.parallel.settings.training_layout_problems): ``none`` (the whole model on each
device), ``fsdp`` or ``ep`` (transformers 5 only). Every job is bf16 with activation checkpointing, micro-batch 1 and
2,048 tokens per sequence; LoRA is rank 16 on every target with the router frozen (``train.lora``'s defaults).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from moeflow.parallel.settings import training_layout_problems
from moeflow.plan.counts import ParamCount, count_parameters
from moeflow.plan.fit import device_memory, fits
from moeflow.plan.memory import Job
from moeflow.plan.shapes import Shape
from moeflow.settings import REPO_ROOT
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config

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


METHODS = {"full": "full", "lora": "LoRA"}


def job_overrides(devices: int, gib: int, method: str) -> dict[str, Any]:
    """The table's job on ``devices`` cards of ``gib``: the ``moe`` run only (the comparison runs dropped)."""
    return {
        "hardware": {"device": "cuda", "num_devices": devices, "memory_gib_per_device": gib},
        "parallel": {"nproc_per_node": devices, "nnodes": 1, "strategy": "none", "ep_size": 1, "fsdp_size": None},
        "precision": "bf16",
        "data": {"seq_len": 2048},
        "train": {"method": method, "optimizer": "adamw", "micro_batch_size": 1, "gradient_checkpointing": True},
        "runs": {"lora": None, "esft": None, "dense": None},
        "paper": {"dense_runs": []},
    }


def _settings(model: str | None, devices: int, gib: int, method: str) -> dict[str, Any]:
    files = [REPO_ROOT / "config" / "models" / f"{model}.yaml"] if model else []
    return plan_settings(run_config(load(*files, overrides=job_overrides(devices, gib, method)), "moe"))


@functools.cache
def _counted(model: str | None) -> tuple[Shape, ParamCount]:
    settings = _settings(model, 1, 80, "full")
    shape, params, _ = count_parameters(settings["model"], settings["vocab_size"])
    return shape, params


def fitting_layouts(model: str | None, devices: int, gib: int, method: str) -> list[str]:
    """The layouts in which ``method`` fits on the hardware, cheapest (fewest bytes moved) first."""
    shape, params = _counted(model)
    settings = _settings(model, devices, gib, method)
    memory, _ = device_memory(settings, {})
    job = Job.from_settings(settings)
    out = []
    for strategy in ("none", "fsdp", "ep") if devices > 1 else ("none",):
        ep_size = math.gcd(devices, shape.num_experts) if strategy == "ep" else 1
        if strategy == "ep" and (ep_size < 2 or not shape.moe_layers):
            continue
        if training_layout_problems(method, strategy, devices, shape.tie_word_embeddings):
            continue
        variant = dataclasses.replace(
            job, replicated=strategy == "none", expert_parallel=strategy == "ep", ep_size=ep_size, fsdp_size=None
        )
        if fits(shape, params, variant, memory):
            out.append(strategy)
    return out


def method_table() -> str:
    """docs/training.md's table: per model and hardware, each method that fits and the layouts it fits in."""
    lines = ["| model | " + " | ".join(HARDWARE) + " |", "|---|" + "---|" * len(HARDWARE)]
    for name, model in MODELS.items():
        cells = []
        for devices, gib in HARDWARE.values():
            fitting = [
                f"{label} ({', '.join(layouts)})"
                for method, label in METHODS.items()
                if (layouts := fitting_layouts(model, devices, gib, method))
            ]
            cells.append("; ".join(fitting) or "no")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
