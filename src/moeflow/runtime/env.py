"""Collect facts that identify the environment, and compare what is installed with the stack's pins.

The report holds facts only: no timestamps, no free memory, nothing that changes between two runs in
an unchanged environment, so rerunning ``verify_env`` gives the same bytes and reruns nothing
downstream. torch and transformers are imported inside the functions that need them: the Snakefile
imports this module (for :func:`fingerprint`) when it builds the DAG.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from moeflow.runtime.pins import cuda_pinned_versions, pinned_versions


@dataclass(frozen=True)
class VerifyEnvStage:
    """Rule verify_env (moeflow.workflow.keys.verify_env_settings): whether a difference from the pins fails
    (``env.strict``), the runs whose model trusts remote code, and the GPU layout the node is checked against
    (moeflow.runtime.gpu_node.layout)."""

    strict: bool
    trust_remote_code: Mapping[str, bool]
    layout: Mapping[str, Any]


log = logging.getLogger("moeflow.runtime.env")


# The distributions the report names, whether or not the stack pins them.
REPORTED_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "datasets",
    "pyarrow",
    "tensorboard",
    "snakemake",
    "accelerate",
    "peft",
    "safetensors",
    "huggingface-hub",
    "numpy",
    "flash-attn",
)


# Flash-attention 2 kernels need an Ampere or newer GPU.
FLASH_ATTN_MIN_CAPABILITY = (8, 0)


# Experts implementations whose kernels need a GPU, with the transformers function that says why not.
GPU_EXPERTS_CHECKS = {
    "deepgemm": ("transformers.integrations.deepgemm", "is_deepgemm_loadable"),
    "sonicmoe": ("transformers.integrations.sonicmoe", "is_sonicmoe_loadable"),
}


class EnvironmentMismatch(RuntimeError):
    """Strict verification found differences between the installed packages and the stack's pins."""


def fingerprint() -> str:
    """A cheap hash of every installed distribution and its version (no torch import).

    Snakemake evaluates it when it builds the DAG: a package change reruns ``verify_env``.
    """
    pairs = sorted(f"{(dist.metadata['Name'] or '').lower()}=={dist.version}" for dist in metadata.distributions())
    return hashlib.sha256("\n".join(pairs).encode()).hexdigest()[:16]


def normalise_name(dist: str) -> str:
    return dist.strip().lower().replace("_", "-").replace(".", "-")


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_matches(installed: str, pinned: str) -> bool:
    """``installed`` satisfies ``==pinned`` as pip reads it (PEP 440: ``2.13.0+cpu`` satisfies ``==2.13.0``)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(f"=={pinned}").contains(Version(installed), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return installed == pinned


def pin_differences(env_file: str | os.PathLike) -> list[dict[str, Any]]:
    """Every pinned package that is missing or installed at another version, sorted by name.

    Each entry: ``{"package", "pinned", "installed"}`` with ``installed`` None when it is missing.
    """
    differences = []
    for name, pinned in sorted(pinned_versions(env_file).items()):
        installed = installed_version(name)
        if installed is None or not version_matches(installed, pinned):
            differences.append({"package": name, "pinned": pinned, "installed": installed})
    return differences


def optional_cuda_pins(env_file: str | os.PathLike) -> list[dict[str, Any]]:
    """The env file's CUDA-only pins (``cuda_pip:``; flash-attn), sorted by name, each ``{"package", "pinned",
    "installed", "matches"}``: never a difference when missing (a CPU machine does not build them); one
    installed at another version is one (:func:`pin_differences`)."""
    out = []
    for name, pinned in sorted(cuda_pinned_versions(env_file).items()):
        installed = installed_version(name)
        out.append(
            {
                "package": name,
                "pinned": pinned,
                "installed": installed,
                "matches": installed is not None and version_matches(installed, pinned),
            }
        )
    return out


def describe_difference(diff: Mapping[str, Any]) -> str:
    if diff["installed"] is None:
        return f"{diff['package']}: pinned =={diff['pinned']}, not installed"
    return f"{diff['package']}: pinned =={diff['pinned']}, installed {diff['installed']}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_total_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _cgroup_memory_limit_bytes() -> int | None:
    """The container's memory limit (cgroup v2 or v1), or None when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 reports "no limit" as a huge number
            return int(text)
    return None


def _os_release() -> str | None:
    try:
        for line in Path("/etc/os-release").read_text(encoding="utf-8").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


def system_facts() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = _ram_total_bytes()
    limit = _cgroup_memory_limit_bytes()
    return {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "os": platform.system(),
        "os_release": _os_release(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "ram_total_bytes": ram,
        "memory_limit_bytes": limit,
        # What a job on this machine can use: the RAM, or the container's limit when it is lower.
        "ram_usable_bytes": min(ram, limit) if limit else ram,
    }


def _capability(gpu: Mapping[str, Any]) -> tuple[int, int]:
    major, minor = gpu["compute_capability"].split(".")
    return int(major), int(minor)


def torch_facts() -> dict[str, Any]:
    import torch

    def guarded(fn):
        try:
            return fn()
        except Exception:  # a CPU-only build or a missing library: the fact is "not available"
            return None

    cudnn = guarded(torch.backends.cudnn.version)
    nccl = guarded(torch.cuda.nccl.version) if torch.distributed.is_available() else None
    if isinstance(nccl, tuple):
        nccl = ".".join(map(str, nccl))
    gpus = []
    cuda_available = bool(torch.cuda.is_available())
    if cuda_available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                }
            )
    return {
        "version": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn is not None else None,
        "nccl": str(nccl) if nccl is not None else None,
        "cuda_available": cuda_available,
        "gpus": gpus,
        "gpu_summary": (
            f"{len(gpus)} GPU(s): "
            + ", ".join(
                f"{g['name']} ({g['memory_bytes'] / 2**30:.1f} GiB, sm {g['compute_capability']})" for g in gpus
            )
            if gpus
            else "no GPU: torch.cuda.is_available() is False, training runs on the CPU"
        ),
    }


def attention_implementations(gpus: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Which ``attn_implementation`` values can run here, each with the reason."""
    import torch

    sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    out = {
        "eager": {"available": True, "reason": "plain PyTorch matmul and softmax"},
        "sdpa": {
            "available": sdpa,
            "reason": "torch.nn.functional.scaled_dot_product_attention"
            + ("" if sdpa else " is missing from this torch"),
        },
    }
    if importlib.util.find_spec("flash_attn") is None:
        out["flash_attention_2"] = {"available": False, "reason": "flash_attn is not installed"}
        return out
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:
        out["flash_attention_2"] = {
            "available": False,
            "reason": f"flash_attn fails to import: {type(exc).__name__}: {exc}",
        }
        return out
    capable = [g for g in gpus if _capability(g) >= FLASH_ATTN_MIN_CAPABILITY]
    if not gpus:
        reason, available = "flash_attn imports, but there is no CUDA GPU", False
    elif not capable:
        reason, available = (
            f"flash_attn imports, but no GPU has compute capability >= "
            f"{FLASH_ATTN_MIN_CAPABILITY[0]}.{FLASH_ATTN_MIN_CAPABILITY[1]}",
            False,
        )
    else:
        reason, available = f"flash_attn {installed_version('flash-attn')} on {len(capable)} capable GPU(s)", True
    out["flash_attention_2"] = {"available": available, "reason": reason}
    return out


def experts_implementations(gpus: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Which ``experts_implementation`` values can run here (transformers 5 only), each with the reason."""
    from moeflow.runtime import compat

    if not compat.is_transformers_v5():
        return {
            "supported": False,
            "reason": (
                f"transformers {compat.version_of('transformers')} has no experts-implementation switch "
                "(it runs experts in a Python loop); it needs transformers 5, the 'current' stack"
            ),
            "implementations": {},
        }
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if hasattr(torch.nn.functional, "grouped_mm"):
        grouped_kernel = "torch.nn.functional.grouped_mm"
    elif hasattr(torch, "_grouped_mm"):
        grouped_kernel = "torch._grouped_mm"
    else:
        grouped_kernel = "transformers' fallback loop"
    device = "GPU" if gpus else "CPU"
    known = {
        "eager": {"available": True, "reason": "a Python loop over the experts that received tokens"},
        "grouped_mm": {
            "available": True,
            "reason": f"{grouped_kernel} on the {device}" + ("" if gpus else " (no float64 on CPU)"),
        },
        "batched_mm": {
            "available": True,
            "reason": "batched matmul; copies the expert weights per token (memory-hungry)",
        },
    }
    implementations = {}
    for name in sorted(set(ALL_EXPERTS_FUNCTIONS._global_mapping) | {"eager"}):
        if name in known:
            implementations[name] = known[name]
        elif name in GPU_EXPERTS_CHECKS:
            module, function = GPU_EXPERTS_CHECKS[name]
            try:
                getattr(importlib.import_module(module), function)(raise_error=True)
                implementations[name] = {"available": True, "reason": "GPU kernel loadable"}
            except Exception as exc:
                implementations[name] = {"available": False, "reason": f"GPU only: {exc}".splitlines()[0]}
        else:
            implementations[name] = {"available": None, "reason": "registered in transformers; not checked by moeflow"}
    return {"supported": True, "reason": "transformers 5 experts interface", "implementations": implementations}


def collect(
    stack: str,
    env_file: str | os.PathLike,
    trust_remote_code: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """The environment report: facts, the comparison with ``env_file``'s pins, and per-run trust_remote_code.

    Settings that are not facts about the environment (``env.strict``) stay out of it: toggling them
    must not change the report's bytes.
    """
    torch = torch_facts()
    cuda_pins = optional_cuda_pins(env_file)
    differences = pin_differences(env_file) + [
        {k: pin[k] for k in ("package", "pinned", "installed")}
        for pin in cuda_pins
        if pin["installed"] is not None and not pin["matches"]
    ]
    return {
        "stack": stack,
        "system": system_facts(),
        "torch": torch,
        "packages": {name: installed_version(name) for name in REPORTED_PACKAGES},
        "attention_implementations": attention_implementations(torch["gpus"]),
        "experts_implementations": experts_implementations(torch["gpus"]),
        "pins": {
            "env_file": Path(env_file).as_posix(),
            "pinned_packages": len(pinned_versions(env_file)),
            "differences": differences,
            "matches": not differences,
            "optional_cuda": cuda_pins,
        },
        "trust_remote_code": {run: bool(v) for run, v in sorted((trust_remote_code or {}).items())},
    }


def enforce(report: Mapping[str, Any], strict: bool) -> list[str]:
    """``env.strict``: raise listing every difference from the pins; otherwise log and return them as warnings."""
    differences = report["pins"]["differences"]
    lines = [describe_difference(d) for d in differences]
    if differences and strict:
        listing = "\n".join(f"  - {line}" for line in lines)
        raise EnvironmentMismatch(
            f"the installed packages differ from the pins of {report['pins']['env_file']} "
            f"({len(differences)} difference(s)):\n{listing}\n"
            f"env.strict is true: install exactly these pins (make env, or pip install -r of tools/pip_pins.py's "
            f"output), or set env.strict: false to record the differences and go on."
        )
    warnings = [f"differs from {report['pins']['env_file']}: {line}" for line in lines]
    remote = [run for run, trusted in report["trust_remote_code"].items() if trusted]
    if remote:
        warnings.append(
            f"run(s) {', '.join(remote)} set model.trust_remote_code: they execute code from the model folder"
        )
    for warning in warnings:
        log.warning(warning)
    return warnings


def device_memory_bytes(report: Mapping[str, Any], device: str) -> tuple[int | None, str]:
    """Memory of one device of kind ``device`` ('cpu' or 'cuda') as measured here, and where it comes from."""
    if device == "cpu":
        return int(report["system"]["ram_usable_bytes"]), "RAM of this machine (verify_env report)"
    gpus = report["torch"]["gpus"]
    if not gpus:
        return None, "no GPU here (verify_env report)"
    smallest = min(gpus, key=lambda g: g["memory_bytes"])
    return int(smallest["memory_bytes"]), f"smallest GPU here: {smallest['name']} (verify_env report)"


def _yes_no(flag: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}[flag]


def render_markdown(report: Mapping[str, Any]) -> str:
    """The human-readable report (same facts as the JSON)."""
    system, torch = report["system"], report["torch"]
    lines = [
        f"# Environment report (stack `{report['stack']}`)",
        "",
        "## System",
        "",
        "| fact | value |",
        "|---|---|",
        f"| Python | {system['python']} ({system['python_implementation']}) |",
        f"| OS | {system['os_release'] or system['os']}, kernel {system['kernel']}, {system['machine']} |",
        f"| CPU | {system['cpu_model']}, {system['cpu_count']} logical CPUs ({system['cpus_usable']} usable) |",
        f"| RAM | {system['ram_total_bytes'] / 2**30:.2f} GiB total, "
        f"{system['ram_usable_bytes'] / 2**30:.2f} GiB usable |",
        f"| torch | {torch['version']} |",
        f"| CUDA runtime | {torch['cuda_runtime'] or 'none (CPU build)'} |",
        f"| cuDNN | {torch['cudnn'] or 'none'} |",
        f"| NCCL | {torch['nccl'] or 'none'} |",
        f"| GPUs | {torch['gpu_summary']} |",
        "",
        "## Packages",
        "",
        "| package | version |",
        "|---|---|",
        *(f"| {name} | {version or 'not installed'} |" for name, version in report["packages"].items()),
        "",
        "## Attention implementations",
        "",
        "| implementation | runs here | why |",
        "|---|---|---|",
        *(
            f"| {name} | {_yes_no(entry['available'])} | {entry['reason']} |"
            for name, entry in report["attention_implementations"].items()
        ),
        "",
        "## Experts implementations",
        "",
    ]
    experts = report["experts_implementations"]
    if experts["supported"]:
        lines += ["| implementation | runs here | why |", "|---|---|---|"]
        lines += [f"| {n} | {_yes_no(e['available'])} | {e['reason']} |" for n, e in experts["implementations"].items()]
    else:
        lines.append(f"Not available on this stack: {experts['reason']}.")
    lines += [
        "",
        "`model.experts_implementation: auto` is chosen per MoE shape, device and precision by timing one MoE block "
        "under each implementation that runs here (rule choose_experts: results/<stack>/experts/<key>/timings.json, "
        "shown in the paper's environment table).",
    ]
    pins = report["pins"]
    lines += ["", f"## Pins ({pins['env_file']}, {pins['pinned_packages']} packages)", ""]
    if pins["matches"]:
        lines.append("Every pinned package is installed at its pinned version.")
    else:
        lines += [f"{len(pins['differences'])} difference(s) (with env.strict: true the stage fails instead):", ""]
        lines += [f"- {describe_difference(d)}" for d in pins["differences"]]
    for pin in pins["optional_cuda"]:
        state = "not installed" if pin["installed"] is None else f"installed {pin['installed']}"
        lines.append(
            f"- optional CUDA pin {pin['package']}=={pin['pinned']}: {state} (CUDA nodes only: "
            f"pip install --no-build-isolation $(python tools/pip_pins.py --cuda {pins['env_file']}))"
        )
    lines += ["", "## trust_remote_code per run", ""]
    lines += [f"- `{run}`: {_yes_no(flag)}" for run, flag in report["trust_remote_code"].items()] or [
        "- off for every run"
    ]
    return "\n".join(lines) + "\n"
