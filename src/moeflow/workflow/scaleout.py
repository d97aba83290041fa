"""Planning for real scale: what a SLURM profile requests, the layout on it, memory per GPU and the cost.

A cluster run is a model overlay (``config/models/*.yaml``) plus the hardware overlay that sits next to
the SLURM profile it is submitted with (``profiles/<profile>/moeflow.yaml``: ``hardware`` and
``parallel`` for exactly what the profile's training rules request). :func:`profile_request` reads the
request from the profile, :func:`layout` the ranks and sharding from the config, and
:func:`scaleout_plan` combines them with the memory planner (:mod:`moeflow.plan`, unchanged numbers)
and a cost estimate.

Cost: training FLOPs are ``6 x N x tokens``, ``N`` the FLOP-bearing active parameters (the input embedding's
lookup is no matmul; forward 2N, backward 4N per token; attention's sequence-length term and the recomputation
of gradient checkpointing are not counted as useful work), at an assumed model-FLOP utilisation of the GPU's
dense bf16 peak. ``ASSUMED_MFU`` is an assumption, not a measurement: MoE fine-tuning with expert-parallel
all-to-all and checkpointing typically reaches 0.2-0.35 of peak on H100s; 0.25 is used unless the caller gives
another value.

No torch or transformers at import time (the Snakefile may import this module while building the DAG).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moeflow.plan.counts import count_parameters
from moeflow.plan.fit import HEADROOM, gib, phase_plans, verdict, worst_phase
from moeflow.plan.memory import GIB, PHASES, Job, PlanMemoryStage, memory_per_device, phase_memory, worst_device_total
from moeflow.plan.proposals import fewest_devices
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import deep_merge

PROFILES = REPO_ROOT / "profiles"


MODELS = REPO_ROOT / "config" / "models"


TRAINING_RULE = "train_model"


# Memory (GiB, as the planner counts it) and dense bf16 peak (FLOP/s, without sparsity) per GPU model,
# by the names SLURM clusters commonly give them in --gpus=<model>:<n>.
GPUS: dict[str, dict[str, float]] = {
    "h100": {"memory_gib": 80, "bf16_flops": 989e12},  # H100 SXM 80GB
    "h200": {"memory_gib": 141, "bf16_flops": 989e12},
    "a100": {"memory_gib": 80, "bf16_flops": 312e12},  # A100 SXM 80GB
    "l40s": {"memory_gib": 48, "bf16_flops": 362e12},
    "rtx4090": {"memory_gib": 24, "bf16_flops": 165e12},
}


ASSUMED_MFU = 0.25


DEFAULT_TOKEN_BUDGET = 1_000_000_000  # a fine-tune of one billion training tokens


class ScaleoutError(ValueError):
    """A profile or layout that cannot be planned, with what to change."""


@dataclass(frozen=True)
class Request:
    """What a SLURM profile requests for one rule (snakemake-executor-plugin-slurm resources)."""

    profile: str
    rule: str
    partition: str
    gpus: int  # in total, over all nodes
    nodes: int
    gpu_model: str
    mem_mb: int  # host memory per node
    runtime_min: int

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def gpu_memory_gib(self) -> float:
        return GPUS[self.gpu_model]["memory_gib"]

    @property
    def gpu_peak_flops(self) -> float:
        return GPUS[self.gpu_model]["bf16_flops"]


def profile_config(profile: str, profiles: Path = PROFILES) -> dict[str, Any]:
    path = profiles / profile / "config.yaml"
    if not path.is_file():
        raise ScaleoutError(f"no SLURM profile {profile!r}: {path} does not exist")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def profile_request(profile: str, rule: str = TRAINING_RULE, profiles: Path = PROFILES) -> Request:
    """The resources ``profile`` gives ``rule`` (its ``set-resources`` over ``default-resources``)."""
    cfg = profile_config(profile, profiles)
    res = dict(cfg.get("default-resources") or {}) | dict((cfg.get("set-resources") or {}).get(rule) or {})
    model = str(res.get("gpu_model", "")).lower()
    if not res.get("gpu"):
        raise ScaleoutError(f"profiles/{profile}: rule {rule!r} requests no GPUs (set-resources: {rule}: gpu: N)")
    if model not in GPUS:
        raise ScaleoutError(f"profiles/{profile}: gpu_model {model!r} of rule {rule!r} is not one of {', '.join(GPUS)}")
    nodes = int(res.get("nodes", 1))
    if int(res["gpu"]) % nodes:
        raise ScaleoutError(
            f"profiles/{profile}: rule {rule!r} requests {res['gpu']} GPUs on {nodes} nodes: use a multiple"
        )
    return Request(
        profile, rule, res["slurm_partition"], int(res["gpu"]), nodes, model, int(res["mem_mb"]), int(res["runtime"])
    )


def hardware_overlay(profile: str, profiles: Path = PROFILES) -> Path:
    """The config overlay with the ``hardware`` and ``parallel`` sections of what ``profile`` requests."""
    return profiles / profile / "moeflow.yaml"


def request_problems(cfg: Mapping[str, Any], request: Request) -> list[str]:
    """Where a config's hardware and ranks differ from what the profile's training rule gets."""
    hw, par = cfg["hardware"], cfg["parallel"]
    problems = []
    if hw["device"] != "cuda" or hw["num_devices"] != request.gpus:
        problems.append(
            f"hardware: {hw['num_devices']} x {hw['device']}, "
            f"but profiles/{request.profile} requests {request.gpus} GPUs"
        )
    if hw["memory_gib_per_device"] != request.gpu_memory_gib:
        problems.append(
            f"hardware.memory_gib_per_device: {hw['memory_gib_per_device']}, "
            f"but a {request.gpu_model} has {request.gpu_memory_gib} GiB"
        )
    if (par["nproc_per_node"], par["nnodes"]) != (request.gpus_per_node, request.nodes):
        problems.append(
            f"parallel: {par['nproc_per_node']} ranks x {par['nnodes']} nodes, but profiles/{request.profile} "
            f"gives {request.gpus_per_node} GPUs x {request.nodes} nodes"
        )
    return problems


def layout(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Ranks and sharding of a config's ``parallel`` section, resolved (what moeflow.parallel sets up)."""
    par = cfg["parallel"]
    world = par["nproc_per_node"] * par["nnodes"]
    strategy = par["strategy"]
    fsdp = par["fsdp_size"] or (world if strategy in ("fsdp", "ep") else 1)
    ep = par["ep_size"]
    out = {
        "world_size": world,
        "nproc_per_node": par["nproc_per_node"],
        "nnodes": par["nnodes"],
        "strategy": strategy,
        "fsdp_size": fsdp,
        "ep_size": ep,
        "data_parallel_replicas": world // fsdp,
        "gradient_checkpointing": cfg["train"]["gradient_checkpointing"],
        "needs_transformers_5": strategy == "ep",
    }
    num_experts = _num_experts(cfg)
    if num_experts:
        out["num_experts"] = num_experts
        out["experts_per_rank"] = num_experts / ep if ep > 1 else num_experts
    return out


def _num_experts(cfg: Mapping[str, Any]) -> int:
    model = cfg["model"]["config"]
    return int(model.get("num_experts") or model.get("n_routed_experts") or model.get("num_local_experts") or 0)


def cost(
    flop_bearing_parameters: int, tokens: int, gpus: int, peak_flops: float, mfu: float = ASSUMED_MFU
) -> dict[str, float]:
    """GPU-hours and wall-clock hours for ``tokens`` training tokens from ``6 N tokens`` FLOPs, ``N`` the
    FLOP-bearing active parameters per token (ParamCount.flop_bearing)."""
    flops = 6 * flop_bearing_parameters * tokens
    gpu_seconds = flops / (peak_flops * mfu)
    return {
        "tokens": tokens,
        "flops": flops,
        "assumed_mfu": mfu,
        "peak_flops_per_gpu": peak_flops,
        "gpu_hours": gpu_seconds / 3600,
        "wall_hours": gpu_seconds / 3600 / gpus,
        "tokens_per_s_per_gpu": peak_flops * mfu / (6 * flop_bearing_parameters),
    }


def placement(request: Request) -> dict[str, Any]:
    """The config overlay of what ``request`` gets: its ``hardware`` and its ranks (not the layout)."""
    return {
        "hardware": {"device": "cuda", "num_devices": request.gpus, "memory_gib_per_device": request.gpu_memory_gib},
        "parallel": {"nproc_per_node": request.gpus_per_node, "nnodes": request.nodes},
    }


def phases_on(settings: PlanMemoryStage, request: Request) -> dict[str, Any]:
    """Every phase per GPU (GiB) and per node's host (GiB, against the request's ``mem_mb``) of the
    planner's ``settings``, with the worst phase and the verdict (the worst of the device and the host)."""
    shape, params, _ = count_parameters(settings.model, settings.vocab_size)
    job = Job.from_settings(settings)
    memory = int(request.gpu_memory_gib * GIB)
    phases = phase_plans(phase_memory(shape, params, job), job, memory, request.mem_mb * 2**20)
    worst = worst_phase(phases, "device_bytes")
    host = worst_phase(phases, "host_per_node_bytes")
    order = ("fits", "tight", "does_not_fit")
    return {
        "job": job,
        "device_gib": {name: phase["device_gib"]["total"] for name, phase in phases.items()},
        "host_per_node_gib": {name: gib(phase["host_per_node_bytes"]) for name, phase in phases.items()},
        "worst_phase": worst,
        "worst_host_phase": host,
        "verdict": max(phases[worst]["verdict"], phases[host]["host_verdict"], key=order.index),
    }


def scaleout_plan(
    cfg: Mapping[str, Any],
    request: Request,
    tokens: int = DEFAULT_TOKEN_BUDGET,
    mfu: float = ASSUMED_MFU,
) -> dict[str, Any]:
    """Memory per GPU for the config's layout on what ``request`` gets, the verdict, and the cost.

    The config's ``hardware`` and ``parallel`` ranks are replaced by the request (so a config can be
    checked against any profile); ``fewer`` is the same plan one node (or, on one node, half the GPUs)
    smaller, for the refusal. ``per_gpu_gib`` are the step's terms; the verdict is the worst phase's."""
    placed = deep_merge(cfg, placement(request))
    settings = typed(PlanMemoryStage, plan_settings(placed))
    shape, params, _ = count_parameters(settings.model, settings.vocab_size)
    lay = layout(placed)
    job = Job.from_settings(settings)
    memory = int(request.gpu_memory_gib * GIB)

    def at(gpus: int) -> dict[str, Any]:
        sized = dataclasses.replace(job, num_devices=gpus)
        per_device = memory_per_device(shape, params, sized)
        return {
            "gpus": gpus,
            "per_gpu_gib": {k: gib(v) for k, v in per_device.items()},
            "worst_phase_gib": gib(worst_device_total(shape, params, sized)),
            "verdict": verdict(worst_device_total(shape, params, sized), memory),
        }

    fewer_gpus = request.gpus - request.gpus_per_node if request.nodes > 1 else request.gpus // 2
    return {
        "profile": request.profile,
        "request": dataclasses.asdict(request) | {"gpu_memory_gib": request.gpu_memory_gib},
        "model_type": shape.model_type,
        "parameters": {
            "total": params.total,
            "active_per_token": params.active,
            "flop_bearing_per_token": params.flop_bearing,
        },
        "layout": lay,
        "job": job.as_dict() | {"num_devices": request.gpus},
        "on_request": at(request.gpus),
        "on_fewer": at(max(1, fewer_gpus)),
        "min_gpus": fewest_devices(shape, params, job, memory),  # LoRA: 1 or none (its adapters are not sharded)
        "usable_fraction": 1 - HEADROOM,
        "cost": cost(params.flop_bearing, tokens, request.gpus, request.gpu_peak_flops, mfu),
    }


def markdown_row(name: str, p: Mapping[str, Any]) -> str:
    """One Markdown line of a model's scale-out plan on its profile: per-GPU memory, fewest GPUs, cost."""
    lay, on, c = p["layout"], p["on_request"], p["cost"]
    g = on["per_gpu_gib"]
    states = sum(g.get(term, 0) for term in ("weights", "gradients", "optimizer"))  # none under CPU offload
    return (
        f"| {name} | {p['parameters']['total'] / 1e9:.1f}B / {p['parameters']['active_per_token'] / 1e9:.2f}B "
        f"| {p['request']['gpus']} x {p['request']['gpu_model'].upper()} "
        f"({p['request']['nodes']} node{'s' if p['request']['nodes'] > 1 else ''}) "
        f"| {lay['strategy']}: FSDP {lay['fsdp_size']}, EP {lay['ep_size']} "
        f"| {'on' if lay['gradient_checkpointing'] else 'off'} "
        f"| {states:.1f} | {g['unsharded_layer']:.1f} | {g['activations']:.1f} "
        f"| **{g['total']:.1f}** of {p['request']['gpu_memory_gib']} "
        f"| {p['min_gpus']} | {c['gpu_hours']:.0f} GPU-h ({c['wall_hours']:.1f} h) | `profiles/{p['profile']}` |"
    )


# docs/memory-plan.md's table of every phase at real scale (phase_table): each shipped large model on 1 to 8 nodes
# of the slurm profile's node (8 x H100 80GB, its mem_mb), in the layout of the config its cluster runs use for a full
# fine-tune (the parallel section of that profile's overlay: Qwen3-30B-A3B's FSDP; Step-3.5-Flash's experts split
# within a node, the rest FSDP), and LoRA in the one layout moeflow runs it in on several ranks (strategy none:
# every rank holds the frozen base and the adapters).
PHASE_TABLE_PROFILE = "slurm"


PHASE_TABLE_NODES = (1, 2, 4, 8)


# model name: (its config/models overlay, the profile whose moeflow.yaml holds the layout of its cluster runs)
PHASE_TABLE_MODELS = {
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", "slurm"),
    "Step-3.5-Flash": ("step3p5-flash", "slurm-multinode"),
}


LAYOUT_KEYS = ("strategy", "ep_size", "fsdp_size")  # what a run's layout is, whatever ranks it is placed on


# LoRA's layout in the phase table: sharded where the stack shards its adapters (FSDP2), else whole on every GPU.
LORA_LAYOUT = {"strategy": "fsdp" if compat.fsdp2_available() else "none", "ep_size": 1, "fsdp_size": None}


VERDICT_WORDS = {"fits": "fits", "tight": "tight", "does_not_fit": "**no**"}


def phase_rows(profile: str = PHASE_TABLE_PROFILE, nodes: tuple[int, ...] = PHASE_TABLE_NODES) -> list[dict[str, Any]]:
    """The plan of every phase for each model, fine-tune method and node count of docs/memory-plan.md's table."""
    base = profile_request(profile)
    rows = []
    for name, (model, cluster) in PHASE_TABLE_MODELS.items():
        overlay = yaml.safe_load(hardware_overlay(cluster).read_text(encoding="utf-8"))
        parallel = {key: overlay["parallel"][key] for key in LAYOUT_KEYS}
        for method in ("full", "lora"):
            for n in nodes:
                request = dataclasses.replace(base, gpus=base.gpus_per_node * n, nodes=n)
                layout = {"train": {"method": method}, "parallel": parallel if method == "full" else LORA_LAYOUT}
                overrides = deep_merge(placement(request), layout)
                cfg = run_config(load(MODELS / f"{model}.yaml", overrides=overrides), "moe")
                planned = phases_on(typed(PlanMemoryStage, plan_settings(cfg)), request)
                rows.append({"model": name, "method": method, "request": request, **planned})
    return rows


def phase_table(profile: str = PHASE_TABLE_PROFILE, nodes: tuple[int, ...] = PHASE_TABLE_NODES) -> str:
    """docs/memory-plan.md's table: per GPU and phase (GiB), a node's host memory in its worst phase, and whether it
    fits (the worst of the device and the host; "tight": within the card but not the planner's headroom)."""
    rows = phase_rows(profile, nodes)
    head = "| model | fine-tune | layout | GPUs | " + " | ".join(PHASES) + " | host per node | fits |"
    lines = [head, "|---|---|---|---|" + "---:|" * len(PHASES) + "---|---|"]
    for row in rows:
        job, request = row["job"], row["request"]
        layout_name = {"none": "none (whole per GPU)", "fsdp": "fsdp", "ep": f"ep {job.ep_size} + fsdp"}[job.strategy]
        host = row["worst_host_phase"]
        cells = [
            row["model"],
            {"lora": "LoRA", "esft": "ESFT"}.get(row["method"], "full"),
            layout_name,
            f"{request.gpus} ({request.nodes} x {request.gpus_per_node})",
            *(f"{row['device_gib'][phase]:.1f}" for phase in PHASES),
            f"{row['host_per_node_gib'][host]:.1f} ({host})",
            VERDICT_WORDS[row["verdict"]] + ("" if row["verdict"] == "fits" else f" ({row['worst_phase']})"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def wall_hours_fit(runtime_min: int, p: Mapping[str, Any]) -> bool:
    """Whether the profile's time limit covers the estimated wall-clock time of the token budget."""
    return runtime_min / 60 >= math.ceil(p["cost"]["wall_hours"])
