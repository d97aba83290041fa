"""The Trainer's full checkpoints: one format for every layout, safetensors plus JSON, never pickle.

A checkpoint folder (written atomically by rank 0) holds ``model.safetensors`` (whole weights by
parameter name), ``optimizer.safetensors`` (AdamW's state as ``<parameter name>/<state key>``),
``rng.safetensors`` (every rank's RNG states as ``rank<r>.<generator>``), ``trainer_state.json`` (step,
data position, guard state, the metrics history without timings, the optimizer's scalars and groups),
``timings.json`` (the measured part of the history) and any extra JSON files the caller adds. Resumable
checkpoints are ``step-<8 digits>`` folders inside a folder keyed by :func:`checkpoint_key`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from . import distributed as D
from .config import stable_hash
from .files import atomic_dir, read_json, write_json
from .stage import code_version

CHECKPOINT_DIR = re.compile(r"^step-(\d{8})$")
CHECKPOINT_FILES = ("trainer_state.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors")
# Measured, not computed: kept out of trainer_state.json so that a checkpoint's state is deterministic.
TIMING_KEYS = ("seconds", "tokens_per_s", "flops_per_s", "mfu", "memory_mib")

# Optimizer state in safetensors: "<parameter name>/<state key>" (names hold dots, never a slash).
OPTIM_KEY_SEPARATOR = "/"


def _flatten_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``moeflow.distributed.full_state_dict``'s optimizer state (keyed by parameter name) as safetensors
    tensors plus JSON (scalars and parameter groups)."""
    tensors, scalars = {}, {}
    for name, per_param in state["state"].items():
        for key, value in per_param.items():
            flat = f"{name}{OPTIM_KEY_SEPARATOR}{key}"
            if isinstance(value, torch.Tensor):
                tensors[flat] = value.detach().cpu().contiguous()
            else:
                scalars[flat] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, _, key = flat.rpartition(OPTIM_KEY_SEPARATOR)
        state.setdefault(name, {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _without_shared_memory(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the second and later ones."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return out


def fingerprint_paths(paths: Sequence[str | os.PathLike]) -> list[Any]:
    """Identify input files/folders cheaply: relative names, sizes and modification times."""
    out = []
    for path in sorted(map(str, paths)):
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        out.append(
            [
                path,
                [
                    [f.relative_to(p).as_posix() if p.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns]
                    for f in files
                    if f.exists()
                ],
            ]
        )
    return out


def checkpoint_key(settings: Mapping[str, Any], inputs: Sequence[str | os.PathLike]) -> str:
    """The resume key: a hash of the stage's settings, its inputs and the moeflow code."""
    return stable_hash({"settings": settings, "inputs": fingerprint_paths(inputs), "code": code_version()}, 16)


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (its trainer_state.json written) in ``folder``, or None."""
    if not folder.is_dir():
        return None
    steps = sorted(p for p in folder.iterdir() if CHECKPOINT_DIR.match(p.name) and (p / "trainer_state.json").is_file())
    return steps[-1] if steps else None


def step_folder(folder: Path, step: int) -> Path:
    """Where the resumable checkpoint of ``step`` goes inside the keyed ``folder``."""
    return folder / f"step-{step:08d}"


def remove_other_checkpoints(folder: Path, keep: Path) -> None:
    """Delete the resumable checkpoints in ``folder`` other than ``keep`` (rank 0, after saving ``keep``)."""
    for old in sorted(folder.iterdir()):
        if CHECKPOINT_DIR.match(old.name) and old.name != keep.name:
            shutil.rmtree(old, ignore_errors=True)


def without_timings(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The history records as trainer_state.json keeps them: without the measured keys."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in history]


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG states: torch's, and the device's on CUDA."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    extra_json: Mapping[str, Any] | None = None,
) -> None:
    """A full checkpoint at ``path``: ``state`` (JSON: the trainer's step, data position, guard state
    and history without timings) plus the optimizer's metadata in trainer_state.json, the timings of
    ``history`` in timings.json, weights, optimizer state and every rank's RNG states (safetensors), and
    ``extra_json`` ({file name: object}). A collective: every rank calls it, rank 0 writes, and it returns
    once the checkpoint is complete."""
    weights, optim_state = D.full_state_dict(model, optimizer, rank0_only=True)
    device = next(model.parameters()).device
    rng = D.gather_objects(rng_states(device))
    if D.rank() == 0:
        tensors, meta = _flatten_optimizer(optim_state)
        with atomic_dir(path) as folder:
            save_file(_without_shared_memory(weights), str(folder / "model.safetensors"))
            save_file(tensors, str(folder / "optimizer.safetensors"))
            save_file(
                {f"rank{r}.{k}": v for r, states in enumerate(rng) for k, v in states.items()},
                str(folder / "rng.safetensors"),
            )
            write_json(folder / "trainer_state.json", {**state, "optimizer": meta})
            write_json(folder / "timings.json", [{k: r[k] for k in TIMING_KEYS if k in r} for r in history])
            for name, obj in (extra_json or {}).items():
                write_json(folder / name, obj)
    D.barrier()


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load weights and optimizer state from a full checkpoint into ``model`` and ``optimizer`` (every rank
    keeps its own shards), set this rank's RNG states (rank 0's for a checkpoint saved by fewer ranks),
    and return the trainer's state, its history with the timings put back."""
    path = Path(path)
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} lacks {', '.join(missing)}: moeflow reads checkpoints as safetensors plus JSON only "
            "(pickle files are never loaded: unpickling can run code). Delete the folder to start the stage afresh"
        )
    state = read_json(path / "trainer_state.json")
    optim_state = _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    D.load_full_state_dict(model, load_file(str(path / "model.safetensors")), optimizer, optim_state)
    rng = load_file(str(path / "rng.safetensors"))
    rank, device = D.rank(), next(model.parameters()).device
    mine = f"rank{rank}" if f"rank{rank}.torch" in rng else "rank0"
    torch.set_rng_state(rng[f"{mine}.torch"])
    if device.type == "cuda" and f"{mine}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"{mine}.cuda"], device)
    timings = read_json(path / "timings.json") if (path / "timings.json").is_file() else []
    history = [{**r, **t} for r, t in zip(state["history"], timings)] if timings else list(state["history"])
    return {**state, "history": history}
