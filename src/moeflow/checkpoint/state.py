"""The Trainer's full checkpoints: sharded through ``torch.distributed.checkpoint`` (DCP), never pickle.

A checkpoint folder holds ``shard-<rank>.safetensors`` (each rank's chunks of the weights, every
parameter and persistent buffer, and of AdamW's tensors: ``model/<name>``, ``optimizer/<name>/<key>``),
``dcp_metadata.json`` (DCP's map of which file holds which chunk: ``moeflow.checkpoint.storage``),
``rng.safetensors`` (every rank's RNG states as ``rank<r>.<generator>``), ``trainer_state.json`` (step,
data position, guard state, the metrics history without timings, the optimizer's scalars and groups,
every DCP key's whole shape), ``timings.json`` (the measured part of the history) and any extra JSON
files the caller adds.

Every rank writes only its own pieces (``moeflow.checkpoint.pieces.state_pieces``: each tensor flattened, a rank's share
one contiguous range of its elements, as its layout holds it; the ranks of an unsharded model split the
writes; a tied parameter once, under its first name) into
``.<name>.partial`` beside the final folder; once all have written, rank 0 adds the JSON files and renames
the folder into place, so a kill leaves the previous checkpoint whole. Loading reads into the shards of
this run's model, whatever layout and world size saved it (DCP reshards). Resumable checkpoints are
``step-<8 digits>`` folders inside a folder keyed by :func:`checkpoint_key`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moeflow.checkpoint.pieces import StatePieces, state_pieces
from moeflow.checkpoint.storage import (
    METADATA_FILE,
    Piece,
    PieceLoadPlanner,
    PieceSavePlanner,
    ShardReader,
    ShardWriter,
    piece_tensors,
)
from moeflow.model.parameters import clean_name
from moeflow.model.safetensors_files import SafetensorsWriter, read_header, read_tensor
from moeflow.model.wrappers import unwrap
from moeflow.parallel import process_group
from moeflow.parallel.process_group import barrier, gather_objects
from moeflow.runtime.files import disk_full_error, read_json, replace_dir, stable_hash, write_json
from moeflow.runtime.host_copies import model_device
from moeflow.runtime.stage import code_version, kill_point

CHECKPOINT_DIR = re.compile(r"^step-(\d{8})$")


PARTIAL_DIR = re.compile(r"^\.step-(\d{8})\.partial$")


STATE_FILE = "trainer_state.json"


RNG_FILE = "rng.safetensors"


CHECKPOINT_FILES = (STATE_FILE, METADATA_FILE, RNG_FILE)


OLD_FORMAT_FILES = ("model.safetensors", "optimizer.safetensors")


# Measured, not computed: kept out of trainer_state.json so that a checkpoint's state is deterministic.
TIMING_KEYS = ("seconds", "tokens_per_s", "flops_per_s", "mfu", "memory_mib")


# DCP keys: "model/<parameter name>", "optimizer/<parameter name>/<state key>" (names hold dots, never a slash).
MODEL_PREFIX, OPTIMIZER_PREFIX, KEY_SEPARATOR = "model/", "optimizer/", "/"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run, naming the folder and what to do."""


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
    """The newest complete checkpoint (:func:`is_complete`) in ``folder``, as this process sees it, or None;
    partial folders (a save that was killed) never count. Ranks resume from :func:`resume_point`."""
    if not folder.is_dir():
        return None
    steps = sorted(p for p in folder.iterdir() if CHECKPOINT_DIR.match(p.name) and is_complete(p))
    return steps[-1] if steps else None


def is_complete(path: Path) -> bool:
    """Whether the checkpoint ``path`` is complete here (rank 0 writes its trainer_state.json last)."""
    return (path / STATE_FILE).is_file()


def resume_point(folder: Path) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's :func:`latest_checkpoint`, broadcast (a collective).
    On several nodes the ranks can see different ``step-*`` folders (a shared filesystem's caches, a node's
    local disk); each rank deciding alone would load different states or hang in the collective load. A
    rank that does not see rank 0's choice complete fails on every rank, naming the ranks and the folder."""
    chosen = process_group.broadcast_object(latest_checkpoint(folder) if process_group.rank() == 0 else None)
    if chosen is None:
        return None
    chosen = Path(chosen)
    blind = [r for r, seen in enumerate(gather_objects(is_complete(chosen))) if not seen]
    if blind:
        raise CheckpointError(
            f"rank 0 resumes from {chosen}, which rank(s) {blind} do not see complete: the checkpoint folder "
            "(the training rule's params.checkpoints) must be on a filesystem every node shares, and "
            "up to date there"
        )
    return chosen


def step_folder(folder: Path, step: int) -> Path:
    """Where the resumable checkpoint of ``step`` goes inside the keyed ``folder``."""
    return folder / f"step-{step:08d}"


def partial_folder(path: Path) -> Path:
    """Where every rank writes the checkpoint ``path`` before rank 0 renames it into place."""
    return path.with_name(f".{path.name}.partial")


def remove_other_checkpoints(folder: Path, keep: Path) -> None:
    """Delete the resumable checkpoints in ``folder`` other than ``keep``, and partial ones left by a killed
    save (rank 0, after saving ``keep``)."""
    for old in sorted(folder.iterdir()):
        if (CHECKPOINT_DIR.match(old.name) and old.name != keep.name) or PARTIAL_DIR.match(old.name):
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


def _dcp_pieces(pieces: StatePieces) -> dict[str, Piece]:
    """``moeflow.checkpoint.pieces.state_pieces`` as one flat map of DCP keys to pieces."""
    flat = {f"{MODEL_PREFIX}{name}": piece for name, piece in pieces.model.items()}
    for name, per_param in pieces.optimizer.items():
        for key, piece in per_param.items():
            flat[f"{OPTIMIZER_PREFIX}{name}{KEY_SEPARATOR}{key}"] = piece
    return flat


def _json_part(pieces: StatePieces) -> dict[str, Any]:
    """What trainer_state.json holds of the optimizer (DCP would pickle it): its scalars and groups."""
    scalars = {
        f"{name}{KEY_SEPARATOR}{key}": value for name, values in pieces.scalars.items() for key, value in values.items()
    }
    return {"param_groups": pieces.param_groups, "scalars": scalars}


def _set_json_part(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: Mapping[str, Any]
) -> None:
    """The optimizer's groups' settings (learning rate, betas, ...) and per-parameter scalars, as saved."""
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {path} has {len(groups)} optimizer parameter groups, this run {len(optimizer.param_groups)}: "
            "it was saved with other settings; delete the folder to start the stage afresh"
        )
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    params = {clean_name(n): p for n, p in unwrap(model).named_parameters()}
    for flat, value in meta["scalars"].items():
        name, _, key = flat.rpartition(KEY_SEPARATOR)
        optimizer.state[params[name]][key] = value


@contextlib.contextmanager
def _dcp_errors(path: Path) -> Iterator[None]:
    """DCP gathers every rank's exception into one CheckpointException: raise the first rank's own (a full
    disk as moeflow.runtime.files.DiskFull naming ``path``), so that the message says what went wrong."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is (unavailable|disabled).*")
            yield
    except CheckpointException as exc:
        first = exc.failures[min(exc.failures)][0]
        raise (disk_full_error(first, path) or first) from None
    except OSError as exc:
        full = disk_full_error(exc, path)
        if full is None:
            raise
        raise full from exc


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    with SafetensorsWriter(path, [(name, t.dtype, t.shape) for name, t in tensors.items()]) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    entries, _ = read_header(path)
    return {name: read_tensor(path, entry) for name, entry in entries.items()}


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    extra_json: Mapping[str, Any] | None = None,
) -> None:
    """A full checkpoint at ``path``: ``state`` (JSON: the trainer's step, data position, guard state
    and history without timings) plus the optimizer's scalars and groups in trainer_state.json, the
    timings of ``history`` in timings.json, every rank's shards of the weights and optimizer state (DCP),
    every rank's RNG states, and ``extra_json`` ({file name: object}). A collective: every rank calls it
    and writes its shards; it returns once rank 0 renamed the complete folder into place."""
    path = Path(path)
    partial, rank = partial_folder(path), process_group.rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        partial.mkdir(parents=True)
    barrier()
    pieces = state_pieces(model, optimizer)
    flat = _dcp_pieces(pieces)
    shapes = _all_shapes(flat)
    rng = gather_objects(rng_states(model_device(model)))
    failure = None
    try:
        with _dcp_errors(path):
            # returns on every rank once all have written and rank 0 wrote dcp_metadata.json
            dcp.save(piece_tensors(flat), storage_writer=ShardWriter(partial, rank), planner=PieceSavePlanner(flat))
            if rank == 0:
                _write_tensors(
                    partial / RNG_FILE, {f"rank{r}.{k}": v for r, states in enumerate(rng) for k, v in states.items()}
                )
                write_json(partial / STATE_FILE, {**state, "optimizer": _json_part(pieces), "shapes": shapes})
                write_json(partial / "timings.json", [{k: r[k] for k in TIMING_KEYS if k in r} for r in history])
                for name, obj in (extra_json or {}).items():
                    write_json(partial / name, obj)
                kill_point("checkpoint.save")
                replace_dir(partial, path)
    except Exception as exc:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        failure = exc
    # rank 0's JSON writes and rename can fail after the collective write: every rank learns of it
    failed = [r for r, f in enumerate(gather_objects(failure is not None)) if f]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"checkpoint {path}: rank {failed[0]} failed to finish it (see its log)")


def _check_files(path: Path) -> None:
    """Refuse a folder that is not a complete checkpoint of this format, saying what to do."""
    if not (path / METADATA_FILE).is_file() and any((path / name).is_file() for name in OLD_FORMAT_FILES):
        raise CheckpointError(
            f"checkpoint {path} is in moeflow's old format (whole model.safetensors and optimizer.safetensors), "
            "which this version no longer reads: delete the folder and rerun the stage that wrote it"
        )
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if not missing:
        files = sorted({chunk["file"] for chunk in read_json(path / METADATA_FILE)["chunks"]})
        missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} lacks {', '.join(missing)}: moeflow reads checkpoints as safetensors plus JSON only "
            "(pickle files are never loaded: unpickling can run code). Delete the folder to start the stage afresh"
        )


def _all_shapes(flat: Mapping[str, Piece]) -> dict[str, list[int]]:
    """Every rank's tensors' whole shapes, by DCP key (a collective): an FSDP1 rank that holds none of a
    parameter may have no optimizer state for it."""
    shapes: dict[str, list[int]] = {}
    for mine in gather_objects({key: list(piece.shape) for key, piece in flat.items()}):
        shapes.update(mine)
    return dict(sorted(shapes.items()))


def _check_layout(path: Path, shapes: Mapping[str, list[int]], saved: Mapping[str, list[int]]) -> None:
    """Refuse a checkpoint whose tensors (names, whole shapes) are not this run's model and optimizer."""
    missing = sorted(set(shapes) - set(saved))
    extra = sorted(set(saved) - set(shapes))
    wrong = [
        f"{key} is {saved[key]} there, {shape} here"
        for key, shape in shapes.items()
        if key in saved and saved[key] != shape
    ]
    problems = (
        ([f"it lacks {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")] if missing else [])
        + (
            [f"it has {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else "") + " that this model lacks"]
            if extra
            else []
        )
        + wrong[:5]
    )
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match this run's model and optimizer: {'; '.join(problems)}. It was saved "
            "by another model or settings: delete the folder to start the stage afresh"
        )


def _optimizer_parameter(key: str) -> str | None:
    """The parameter an ``optimizer/<name>/<state key>`` DCP key belongs to; None for a model key."""
    if not key.startswith(OPTIMIZER_PREFIX):
        return None
    return key.removeprefix(OPTIMIZER_PREFIX).rpartition(KEY_SEPARATOR)[0]


def _never_stepped(optimizer_pieces: Mapping[str, Mapping[str, Piece]], saved: Mapping[str, Any]) -> set[str]:
    """The parameters the checkpoint has no optimizer state for: those that had never had a gradient when it
    was saved (an expert no token reached). The fresh optimizer made a state for them, which must go (it
    would count a step they never took)."""
    keys = {
        name: [f"{OPTIMIZER_PREFIX}{name}{KEY_SEPARATOR}{k}" for k in per_param]
        for name, per_param in optimizer_pieces.items()
    }
    return {name for name, flat in keys.items() if flat and not any(k in saved for k in flat)}


def _drop_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> None:
    for name, param in unwrap(model).named_parameters():
        if clean_name(name) in names:
            optimizer.state.pop(param, None)


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load weights and optimizer state from a full checkpoint into ``model`` and ``optimizer`` (a
    collective: every rank reads only the chunks of its own shards, whatever layout and world size saved
    them), set this rank's RNG states (rank 0's for a checkpoint saved by fewer ranks), and return the
    trainer's state, its history with the timings put back. Call it before the first step."""
    path = Path(path)
    _check_files(path)
    state = read_json(path / STATE_FILE)
    pieces = state_pieces(model, optimizer, init_optimizer=True)
    flat = _dcp_pieces(pieces)
    saved = state["shapes"]
    never_stepped = _never_stepped(pieces.optimizer, saved)
    flat = {k: v for k, v in flat.items() if _optimizer_parameter(k) not in never_stepped}
    _check_layout(path, _all_shapes(flat), saved)
    with _dcp_errors(path):
        dcp.load(piece_tensors(flat), storage_reader=ShardReader(path), planner=PieceLoadPlanner(flat))
    _set_json_part(path, model, optimizer, state["optimizer"])
    _drop_optimizer_state(model, optimizer, never_stepped)
    rng = _read_tensors(path / RNG_FILE)
    rank, device = process_group.rank(), model_device(model)
    mine = f"rank{rank}" if f"rank{rank}.torch" in rng else "rank0"
    torch.set_rng_state(rng[f"{mine}.torch"])
    if device.type == "cuda" and f"{mine}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"{mine}.cuda"], device)
    timings = read_json(path / "timings.json") if (path / "timings.json").is_file() else []
    history = [{**r, **t} for r, t in zip(state["history"], timings)] if timings else list(state["history"])
    return {**state, "history": history}
