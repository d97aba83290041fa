"""The storage layer under ``torch.distributed.checkpoint`` (DCP) for moeflow's checkpoints: no pickle.

:class:`ShardWriter` writes each rank's share of a DCP save into one ``shard-<rank>.safetensors``, a
tensor at a time (a CUDA tensor is staged to the host one at a time too), and the coordinator writes
DCP's metadata (which rank's file holds which chunk of which tensor) as ``dcp_metadata.json``.
:class:`ShardReader` reads them back: every rank reads only the chunks its own state dict needs (DCP's
planner reshards a checkpoint of N ranks into M), and of a chunk only the dim-0 rows it needs. DCP's own
FileSystemWriter/Reader pickle the metadata and non-tensor values; here non-tensor values are refused
(they belong in the checkpoint's JSON files). Works with the StorageWriter/StorageReader interfaces of
torch 2.3 and of the current torch.

Every tensor is stored flattened: a rank's share of it is a :class:`Piece`, a contiguous range of its
row-major elements, which is what each layout holds without a copy (an FSDP1 flat shard's range of each
parameter, FSDP2's and expert parallelism's dim-0 rows, a whole tensor). :class:`PieceSavePlanner` and
:class:`PieceLoadPlanner` are DCP's default planners over pieces: a piece several ranks hold (a whole
tensor of an unsharded model) is written once, the writes balanced over the ranks, and a load reads each
rank's range from whichever saved pieces overlap it, so a checkpoint of any layout and world size loads
into any other.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from moeflow.model.safetensors_files import SafetensorsWriter, read_header, read_tensor, tensor_nbytes
from moeflow.runtime.files import read_json, write_json

METADATA_FILE = "dcp_metadata.json"


def shard_file(rank: int) -> str:
    return f"shard-{rank}.safetensors"


class NotATensor(TypeError):
    """A DCP state dict value that is not a tensor: it would be pickled, and goes to JSON instead."""


def _stored_name(index: MetadataIndex) -> str:
    """A chunk's name inside its rank's file: the state dict key, and the chunk's offset if it has one."""
    offset = tuple(index.offset or ())
    return index.fqn if not any(offset) else f"{index.fqn}@{','.join(map(str, offset))}"


def _storage_key(fqn: str, offset: Any) -> tuple[str, tuple[int, ...]]:
    return fqn, tuple(offset or ())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Piece:
    """This rank's elements ``[offset, offset + local.numel())`` of a tensor of ``shape``, flattened in
    row-major order. ``local``: a 1-D view of the rank's own storage (a load writes into it)."""

    local: torch.Tensor
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))


def _nonempty(pieces: Mapping[str, Piece]) -> dict[str, Piece]:
    return {key: piece for key, piece in pieces.items() if piece.local.numel()}


def piece_tensors(pieces: Mapping[str, Piece]) -> dict[str, torch.Tensor]:
    """The state dict ``dcp.save`` and ``dcp.load`` take with the piece planners: each piece's local view."""
    return {key: piece.local for key, piece in _nonempty(pieces).items()}


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over :class:`Piece` values (``dcp.save(piece_tensors(pieces), ...)``):
    each rank's pieces are 1-D chunks of the flattened tensors; a piece several ranks hold is written by
    one of them (DCP's deduplication, balanced over the ranks), and the global plan is checked to cover
    every tensor exactly once."""

    def __init__(self, pieces: Mapping[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = _nonempty(pieces)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, piece in self.pieces.items():
            chunk = piece.chunk()
            items.append(
                WriteItem(
                    index=MetadataIndex(key, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties.create_from_tensor(piece.local),
                        size=torch.Size([piece.numel]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].local


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over :class:`Piece` values (``dcp.load(piece_tensors(pieces), ...)``):
    each rank reads its range of every flattened tensor from the saved chunks that overlap it, straight
    into the piece's storage."""

    def __init__(self, pieces: Mapping[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = _nonempty(pieces)

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for key, piece in self.pieces.items():
            items += create_read_items_for_chunk_list(key, saved[key], [piece.chunk()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].local


class ShardWriter(StorageWriter):
    """Writes this rank's chunks of a DCP save into ``<directory>/shard-<rank>.safetensors``."""

    def __init__(self, directory: str | os.PathLike, rank: int):
        super().__init__()
        self.directory, self.rank = Path(directory), rank

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        refused = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if refused:
            raise NotATensor(f"checkpoint values that are not tensors would be pickled: {', '.join(refused)}")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / shard_file(self.rank)
        layout = [
            (_stored_name(item.index), item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
            for item in plan.items
        ]
        results = []
        with SafetensorsWriter(path, layout) as writer:
            for item, (name, dtype, shape) in zip(plan.items, layout):
                writer.write(name, planner.resolve_data(item).detach())  # staged to the host one at a time
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=tensor_nbytes(dtype, shape),
                        storage_data={"file": path.name, "name": name},
                    )
                )
        _fsync(path)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stored = {_storage_key(r.index.fqn, r.index.offset): r.storage_data for rank in results for r in rank}
        write_json(self.directory / METADATA_FILE, metadata_to_json(metadata, stored))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class ShardReader(StorageReader):
    """Reads a checkpoint written by :class:`ShardWriter`: each rank only the chunks (and rows) it needs."""

    def __init__(self, directory: str | os.PathLike):
        super().__init__()
        self.directory = Path(directory)
        self.stored: dict[tuple[str, tuple[int, ...]], dict[str, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata, self.stored = metadata_from_json(read_json(self.directory / METADATA_FILE))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file = defaultdict(list)
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise NotATensor(f"checkpoint {self.directory}: {item.dest_index.fqn} is not a tensor")
            stored = self.stored[_storage_key(item.storage_index.fqn, item.storage_index.offset)]
            by_file[stored["file"]].append((item, stored["name"]))
        for file, items in by_file.items():
            path = self.directory / file
            entries, _ = read_header(path)
            for item, name in items:
                chunk = _read_chunk(path, entries[name], item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                target.copy_(chunk)
                planner.commit_tensor(item, target)
                del chunk
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def _read_chunk(path: Path, entry: Any, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The ``lengths`` hypercube at ``offsets`` of a stored chunk: only its dim-0 rows are read from disk."""
    shape = tuple(entry.shape)
    if not shape:
        return read_tensor(path, entry)
    rows = range(offsets[0], offsets[0] + lengths[0])
    part = read_tensor(path, entry, rows=rows)
    return narrow_tensor_by_index(part, (0, *offsets[1:]), lengths)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def metadata_to_json(metadata: Metadata, stored: Mapping[tuple[str, tuple[int, ...]], Mapping[str, str]]) -> dict:
    """DCP's metadata (tensors only) plus where each chunk is stored, as JSON."""
    tensors = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise NotATensor(f"checkpoint value {key} is not a tensor")
        tensors[key] = {
            "dtype": _dtype_name(meta.properties.dtype),
            "requires_grad": meta.properties.requires_grad,
            "size": list(meta.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in meta.chunks],
        }
    planner_data = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    chunks = [{"fqn": fqn, "offset": list(offset), **where} for (fqn, offset), where in sorted(stored.items())]
    return {"tensors": tensors, "planner_data": planner_data, "chunks": chunks}


def metadata_from_json(data: Mapping[str, Any]) -> tuple[Metadata, dict[tuple[str, tuple[int, ...]], dict[str, str]]]:
    state_dict_metadata = {
        key: TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, meta["dtype"]), requires_grad=meta["requires_grad"]),
            size=torch.Size(meta["size"]),
            chunks=[ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in meta["chunks"]],
        )
        for key, meta in data["tensors"].items()
    }
    planner_data = {k: tuple(v) for k, v in data["planner_data"].items()}
    stored = {_storage_key(c["fqn"], c["offset"]): {"file": c["file"], "name": c["name"]} for c in data["chunks"]}
    metadata = Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data)
    return metadata, stored
