"""A model built on the meta device and filled with only the rows each rank owns.

A model built with its parameters on the meta device, then filled from its folder's safetensors files
with only the rows each rank owns, so that no rank materialises parameters it does not hold.

* :func:`parameters_on_meta`: modules built inside it (moeflow.loading.factory builds the folder's model class
  from its config.json there) register their parameters on the meta device (no memory) and keep their
  buffers real: rotary ``inv_freq`` and the other non-persistent buffers are computed at construction and
  are not in the weight files. Persistent buffers are filled from the files.
* :func:`materialize_parameters`: FSDP1's ``param_init_fn`` (one unit at a time, ties kept) and
  :func:`materialize` (after ``fully_shard``, or for an unsharded model): empty storage on the device for
  the (local shards of the) parameters, the buffers kept.
* :func:`fill_from_folder`: every entry of the model's sharded state dict (FSDP1: ShardedTensor, FSDP2:
  DTensor, unsharded: the tensor) gets its owned dim-0 rows from the folder's files (one
  ``model.safetensors`` or an HF index with its files, ``moeflow.model.safetensors_files.weight_files``), read
  with ``os.pread`` straight into the local shard.

transformers 5 stores some weights in the model in another layout than in the files (fused experts:
``experts.gate_up_proj`` of shape (experts, 2 x inner, hidden) from the files' per-expert ``gate_proj`` and
``up_proj``): :func:`file_sources` finds each such parameter's file tensors with transformers' own reverse
conversion (what ``save_pretrained`` writes), applied to broadcast probes of each element's row and offset
(no whole-tensor index), and a rank reads only the file tensors, and of those the rows, that overlap its rows.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeflow.model.parameters import base_name, clean_name, is_adapter
from moeflow.model.quantization import pack, quantized_weights
from moeflow.model.safetensors_files import SafetensorsError, read_elements, read_header, read_tensor, weight_files
from moeflow.model.saved_names import saved_format
from moeflow.model.settings import QUANTIZED_READ_BYTES
from moeflow.model.wrappers import is_fsdp1, unwrap
from moeflow.parallel import dtensors, process_group

META = torch.device("meta")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device != META:
            kwargs = {k: v for k, v in param.__dict__.items()}
            module._parameters[name] = type(param)(param.to(META), requires_grad=param.requires_grad, **kwargs)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def has_meta_parameters(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize_parameters(device: torch.device):
    """FSDP1's ``param_init_fn``: the module's own meta parameters get empty storage on ``device``; a
    parameter tied to one materialised before (tied embeddings) gets the same new parameter."""
    done: dict[int, torch.nn.Parameter] = {}

    def init(module: torch.nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                new = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # moeflow's _moeflow_shape, peft's and transformers' marks
                done[id(param)] = new
            module._parameters[name] = done[id(param)]

    return init


def materialize(
    model: torch.nn.Module, device: torch.device, buffer_device: torch.device | None = None
) -> torch.nn.Module:
    """Empty storage on ``device`` for every meta parameter (after ``fully_shard``: their local shards),
    the buffers kept as they are (``to_empty`` would leave them uninitialised too), on ``buffer_device`` if given
    (CPU offload: the shards on the host, the buffers where the model computes)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if buffer_device is not None:
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(buffer_device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def local_pieces(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """This rank's pieces of a state-dict entry: (local tensor, offset of its first element in the whole
    tensor). FSDP, and transformers' expert parallelism over FSDP (a 2-D mesh: experts ``Shard(0)`` over
    ``ep``, ``_StridedShard(0)`` over ``efsdp``), shard along dim 0 only, so every offset is a row offset
    (other dims 0); rows a rank holds that are not consecutive in the whole tensor are one piece per run."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):  # FSDP1's sharded state dict (torch 2.3)
        return [(shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in value.local_shards()]
    if dtensors.is_dtensor(value):
        local = value.to_local()
        rows = global_rows(value)
        pieces, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                pieces.append((local[start:i], (rows[start],) + (0,) * (value.dim() - 1)))
                start = i
        return pieces or [(local, (0,) * value.dim())]
    return [(value, (0,) * value.dim())]


def global_rows(value: Any) -> list[int]:
    """The whole tensor's row of each local row of a DTensor sharded along dim 0 only (any placement that
    splits another dim: an error naming it), from a one-dimensional probe of the row numbers placed as the
    tensor is (each rank slices its own part: no communication)."""
    from torch.distributed.tensor import Replicate

    other = [p for p in value.placements if not isinstance(p, Replicate) and getattr(p, "dim", None) != 0]
    if other or not value.dim():
        raise RuntimeError(
            f"moeflow: a tensor of shape {list(value.shape)} placed as {value.placements}: the sharded loader reads "
            "rows, and a placement that splits another dimension (tensor parallelism) is not supported"
        )
    return list(_placed_rows(value.shape[0], value.device_mesh, tuple(value.placements), process_group.rank()))


@functools.lru_cache(maxsize=256)
def _placed_rows(rows: int, mesh: Any, placements: tuple, rank: int) -> tuple[int, ...]:
    """:func:`global_rows` for every DTensor of ``rows`` rows placed so: a model has a handful of such layouts
    and hundreds of tensors, and reading the probe back from a GPU waits for the device each time."""
    from torch.distributed.tensor import distribute_tensor

    probe = torch.arange(rows, device=mesh.device_type)
    return tuple(distribute_tensor(probe, mesh, list(placements), src_data_rank=None).to_local().tolist())


# About the most index elements computed at once when a rank places a converted file tensor's elements (at least
# one file row): 8 MB of int64.
INDEX_BLOCK = 2**20


class IndexProbe(torch.Tensor):
    """A broadcast probe of element positions handed to transformers' conversion. Its ``contiguous()`` and
    ``clone()`` return it as it is: only its values matter here, and transformers' Chunk, Split and Transpose
    make each piece contiguous, which would write one index per element of the whole tensor (24 GB of int32 for
    one stacked expert tensor of Step-3.5-Flash)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.contiguous, torch.Tensor.clone):
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


@dataclass(frozen=True)
class Source:
    """Where a file tensor's elements sit in the model's tensor: its shape, the first and last dim-0 row of the
    model's tensor it holds elements of, and, for a file tensor that overlaps the rows asked for
    (:func:`file_sources`), each element's row (``rows``) and offset within that row (``within``), as broadcast
    views of the probes (no index per element). ``runs``: where each file row is one run of consecutive
    elements of the model's flattened tensor (the conversion only took views), ``(start, step, length)``: file
    row ``r`` holds the model's elements ``start + r * step`` onwards, ``length`` of them (a stacked expert
    tensor: one expert's matrix per row); None where it is not so (the elements are then placed by index)."""

    shape: tuple[int, ...]
    first_row: int
    last_row: int
    rows: torch.Tensor | None = None
    within: torch.Tensor | None = None
    runs: tuple[int, int, int] | None = None

    def overlaps(self, rows: range) -> bool:
        return self.first_row < rows.stop and self.last_row >= rows.start

    def index_blocks(self, row_numel: int, file_rows: range | None = None) -> Iterator[tuple[range, torch.Tensor]]:
        """The file tensor's dim-0 rows (``file_rows``: all) in blocks of about :data:`INDEX_BLOCK` elements,
        each with the flat index (into the whole model tensor, int64) of each of its elements."""
        if self.rows is None or self.within is None:
            raise RuntimeError("moeflow: file_sources was asked for other rows than this piece's (a bug)")
        rows, within = (t.as_subclass(torch.Tensor).reshape(t.shape or (1,)) for t in (self.rows, self.within))
        file_rows = range(rows.shape[0]) if file_rows is None else file_rows
        step = max(1, INDEX_BLOCK // max(1, rows[0].numel()))
        for start in range(file_rows.start, file_rows.stop, step):
            block = range(start, min(start + step, file_rows.stop))
            index = within[start : block.stop].to(torch.int64)
            yield block, index.add_(rows[start : block.stop], alpha=row_numel)


def _affine(view: torch.Tensor, probe: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """A view of a probe (an arange's storage: each value is its position) holds ``offset + sum(i * stride)`` at
    index ``i``: (offset, strides), or None for a tensor the conversion copied."""
    if view.untyped_storage().data_ptr() != probe.untyped_storage().data_ptr():
        return None
    return view.storage_offset(), view.stride()


def _row_runs(row_view, row_probe, within_view, within_probe, row_numel: int) -> tuple[int, int, int] | None:
    """:attr:`Source.runs` of a file tensor from its views of the two probes."""
    rows, within = _affine(row_view, row_probe), _affine(within_view, within_probe)
    if rows is None or within is None or not row_view.dim():
        return None
    strides = [row_numel * r + w for r, w in zip(rows[1], within[1])]
    length = 1
    for size, stride in reversed(list(zip(row_view.shape[1:], strides[1:]))):
        if size > 1 and stride != length:
            return None
        length *= size
    return rows[0] * row_numel + within[0], strides[0], length


def _distinct(view: torch.Tensor) -> torch.Tensor:
    """A broadcast view without its repeated (stride-0) dimensions: the same values, each once per position."""
    return view[tuple(0 if stride == 0 else slice(None) for stride in view.stride())]


def _index_dtype(n: int) -> torch.dtype:
    return torch.int16 if n < 2**15 else torch.int32 if n < 2**31 else torch.int64


def _probe(values: torch.Tensor, shape: tuple[int, ...]) -> IndexProbe:
    return values.expand(shape).as_subclass(IndexProbe)


def file_sources(
    model: torch.nn.Module, name: str, shape: tuple[int, ...], rows: range | None = None
) -> dict[str, Source]:
    """The file tensors ``save_pretrained`` writes for the model's tensor ``name``, each as a :class:`Source`
    (``{name: ...}`` when the files hold it as the model does), with element positions kept only for those
    that overlap the model rows ``rows`` (a rank's; None: all). transformers' own reverse conversion is applied
    to broadcast probes (:class:`IndexProbe`: each element's row, then its offset in the row, in the smallest
    integer type that holds them), which stay broadcast views through it: no index the size of the whole
    tensor is built."""
    shape = shape or (1,)
    row_numel = math.prod(shape[1:])
    ones = [1] * (len(shape) - 1)
    row_values = torch.arange(shape[0], dtype=_index_dtype(shape[0])).reshape(-1, *ones)
    placed = {}
    for stored, view in saved_format(model, {name: _probe(row_values, shape)}).items():
        distinct = _distinct(view)
        placed[stored] = (view, int(distinct.min()), int(distinct.max()))
    wanted = {s for s, (_, first, last) in placed.items() if rows is None or (first < rows.stop and last >= rows.start)}
    within = {}
    if wanted:
        within_values = torch.arange(row_numel, dtype=_index_dtype(row_numel)).reshape(1, *shape[1:])
        within = {s: v for s, v in saved_format(model, {name: _probe(within_values, shape)}).items() if s in wanted}
        if set(within) != wanted:
            raise SafetensorsError(f"the saved format of {name!r} is not one layout of its elements ({sorted(placed)})")
    out = {}
    for stored, (view, first, last) in placed.items():
        if stored not in wanted:
            out[stored] = Source(tuple(view.shape), first, last)
            continue
        runs = _row_runs(view, row_values, within[stored], within_values, row_numel)
        out[stored] = Source(tuple(view.shape), first, last, view, within[stored], runs)
    return out


def fill_from_folder(model: torch.nn.Module, path: str | os.PathLike, names_of: Mapping[str, list[str]]) -> None:
    """Fill the model's (local shards of its) parameters and persistent buffers from the folder's files,
    each rank reading only the rows it owns; a LoRA model's base weights (its adapters are not in the folder:
    :func:`place_whole`), a quantized weight's rows read dense and quantized where they land
    (moeflow.model.quantization). ``names_of``: every name of a tied tensor (the files hold one of them). A missing
    tensor, a shape that differs or an index naming a missing file: a SafetensorsError naming the file and the
    tensor."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    folder = Path(path)
    files = weight_files(folder)
    headers = {file: read_header(file)[0] for file in sorted(set(files.values()))}
    if is_fsdp1(model):
        _fill_fsdp1(model, folder, files, headers, names_of)
        return
    sharded = any(dtensors.is_dtensor(p) for p in model.parameters())
    # an unsharded model's own state dict shares its storage (torch 2.3's get_model_state_dict wants a process group)
    state = get_model_state_dict(model) if sharded else model.state_dict()
    base = unwrap(model, peft=True)
    quantized = quantized_weights(model)
    with torch.no_grad():
        for key, value in state.items():
            if is_adapter(key):
                continue  # the adapters start from their seeded draw (place_whole)
            name = base_name(key)
            weight = quantized.get(name)
            shape = weight.dequantize.packing.shape if weight else tuple(value.shape)
            stored = next((n for n in names_of.get(name, [name]) if n in files), None)
            pieces = _pieces(value)
            if stored is not None:
                sources = {stored: None}
            else:  # only this rank's rows' file tensors are placed element by element
                starts = [first for _, first in pieces]
                stops = [first + (local.shape[0] if local.dim() else 1) for local, first in pieces]
                sources = file_sources(base, name, shape, range(min(starts, default=0), max(stops, default=0)))
                if set(sources) == {name}:
                    raise SafetensorsError(f"{folder}: the model's tensor {name!r} is in none of its weight files")
            if weight is None:
                for local, first in pieces:
                    _fill_piece(folder, files, headers, name, shape, sources, local, first)
                continue
            packing, dtype = weight.dequantize.packing, weight.dequantize.dtype
            step = max(1, QUANTIZED_READ_BYTES // (math.prod(shape[1:]) * dtype.itemsize))
            for stored, first in pieces:  # this rank's rows read dense a few at a time, each run quantized alone
                for start in range(0, stored.shape[0], step):
                    rows = stored[start : start + step]
                    dense = torch.empty((rows.shape[0], *shape[1:]), dtype=dtype, device=stored.device)
                    _fill_piece(folder, files, headers, name, shape, sources, dense, first + start)
                    rows.copy_(pack(packing.kind, dense, packing.block))
    if sharded:
        set_model_state_dict(model, state)


def _pieces(value: Any) -> list[tuple[torch.Tensor, int]]:
    """:func:`local_pieces` of a state-dict entry that has elements here, with the row each starts at."""
    return [(local, offset[0] if offset else 0) for local, offset in local_pieces(value) if local.numel()]


def place_whole(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set the model's tensors named in ``tensors`` (by clean name, given whole: LoRA's initial adapters) in
    every layout but FSDP1: each rank copies the rows it holds."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sharded = any(dtensors.is_dtensor(p) for p in model.parameters())
    state = get_model_state_dict(model) if sharded else model.state_dict()
    entries = {clean_name(k): v for k, v in state.items()}
    with torch.no_grad():
        for name, whole in tensors.items():
            for local, offset in local_pieces(entries[name]):
                first = offset[0] if offset else 0
                local.copy_(whole[first : first + local.shape[0]] if local.dim() else whole)
    if sharded:
        set_model_state_dict(model, state)


def _stored_entry(folder: Path, files, headers, name: str, names_of: Mapping[str, list[str]], shape):
    """The file and entry holding the model's tensor ``name`` (under any of its tied names), checked."""
    stored = next((n for n in names_of.get(name, [name]) if n in files), None)
    if stored is None:
        raise SafetensorsError(f"{folder}: the model's tensor {name!r} is in none of its weight files")
    file = files[stored]
    entry = headers[file].get(stored)
    if entry is None:
        raise SafetensorsError(f"{file}: the index maps tensor {stored!r} to this file, which does not hold it")
    if entry.shape != tuple(shape):
        raise SafetensorsError(
            f"{file}: tensor {stored!r} has shape {list(entry.shape)}, the model's {name!r} needs {list(shape)}"
        )
    return file, entry


def _fill_fsdp1(model: torch.nn.Module, folder: Path, files, headers, names_of: Mapping[str, list[str]]) -> None:
    """FSDP1 (torch 2.3): each unit's flat shard holds, per original parameter, a range of its flattened
    elements (``_shard_param_infos``); read exactly those ranges from the files into the shard, and the
    unsharded buffers whole. Nothing is gathered: FSDP1's sharded state dict would unshard every unit and
    copy each rank's rows out of it (a second copy of the rank's weights)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with torch.no_grad():
        for prefix, unit in model.named_modules():
            if not isinstance(unit, FullyShardedDataParallel) or unit._handle is None:
                continue
            flat = unit._handle.flat_param
            base = clean_name(prefix)
            for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
                if not info.in_shard or not info.numel_in_shard:
                    continue
                name = clean_name(f"{base}.{fqn}" if base else fqn)
                file, entry = _stored_entry(folder, files, headers, name, names_of, tuple(shape))
                out = flat.data[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                if entry.dtype == out.dtype:
                    read_elements(file, entry, info.intra_param_start_idx, info.intra_param_end_idx + 1, out)
                else:
                    whole = read_tensor(file, entry).reshape(-1)
                    out.copy_(whole[info.intra_param_start_idx : info.intra_param_end_idx + 1])
        for name, buffer in persistent_buffers(model.module):
            file, entry = _stored_entry(folder, files, headers, name, names_of, tuple(buffer.shape))
            _read_rows(file, entry, range(entry.shape[0]) if entry.shape else range(1), buffer)


def _fill_piece(folder, files, headers, name, shape, sources, local: torch.Tensor, first_row: int) -> None:
    """This rank's piece ``local`` (rows ``first_row``... of the model's tensor ``name``) from the file tensors
    ``sources`` name (:func:`file_sources`; ``None``: the file tensor is the model's). Only file tensors that
    overlap the piece's rows are looked at and read, and of those only the rows that hold the piece's elements;
    every value lands on the piece's device."""
    rows = range(first_row, first_row + (local.shape[0] if local.dim() else 1))
    for stored, source in sources.items():
        if stored not in files:
            raise SafetensorsError(f"{folder}: tensor {stored!r} (of the model's {name!r}) is in none of its files")
        file = files[stored]
        entry = headers[file].get(stored)
        if entry is None:
            raise SafetensorsError(f"{file}: the index maps tensor {stored!r} to this file, which does not hold it")
        want = shape if source is None else source.shape
        if entry.shape != want:
            raise SafetensorsError(
                f"{file}: tensor {stored!r} has shape {list(entry.shape)}, the model's {name!r} needs {list(want)}"
            )
        if source is None:
            _read_rows(file, entry, rows, local)
            continue
        if not source.overlaps(rows):
            continue  # another rank's: not read
        row_numel = local[0].numel() if local.dim() else 1
        lo, hi = rows.start * row_numel, rows.stop * row_numel
        partly = _fill_runs(file, entry, source.runs, lo, hi, local) if source.runs else None
        for file_rows, index in source.index_blocks(row_numel, partly):
            _fill_block(file, entry, file_rows, index, lo, hi, local)


def _fill_runs(file: Path, entry, runs: tuple[int, int, int], lo: int, hi: int, local: torch.Tensor) -> range:
    """The file rows whose run of model elements (:attr:`Source.runs`) lies inside the piece's elements
    ``lo:hi``, read straight into place (file rows whose runs follow each other: in one read). Returns the file
    rows left to place by index: those whose run crosses ``lo`` or ``hi`` (none in the layouts transformers
    converts; an empty range)."""
    start, step, length = runs
    count = entry.shape[0]
    inside = [r for r in range(count) if lo <= start + r * step and start + r * step + length <= hi]
    crossing = [r for r in range(count) if start + r * step < hi and start + r * step + length > lo]
    left = sorted(set(crossing) - set(inside))
    flat, tail = local.view(-1), tuple(entry.shape[1:])
    groups = [inside] if step == length and inside else [[r] for r in inside]
    for group in groups:
        first, n = group[0], len(group)
        at = start + first * step - lo
        _read_rows(file, entry, range(first, first + n), flat[at : at + n * length].view(n, *tail))
    return range(left[0], left[-1] + 1) if left else range(0)


def _fill_block(
    file: Path, entry, file_rows: range, index: torch.Tensor, lo: int, hi: int, local: torch.Tensor
) -> None:
    """The file tensor's rows ``file_rows``, whose elements lie at the model indices ``index``, into ``local``
    (the model's elements ``lo:hi``): read straight into place where the block is a consecutive run inside the
    piece, else element by element (:func:`_scatter_owned`)."""
    flat = index.reshape(-1)
    first = int(flat[0])
    if first >= lo and first + flat.numel() <= hi and _is_range(flat):
        _read_rows(file, entry, file_rows, local.view(-1)[first - lo :][: flat.numel()].view(index.shape))
        return
    _scatter_owned(file, entry, file_rows, index, lo, hi, local)


def _scatter_owned(file: Path, entry, file_rows: range, indices: torch.Tensor, lo: int, hi: int, local: torch.Tensor):
    """The elements of the file tensor's rows ``file_rows`` (at model ``indices``) that fall in ``lo:hi`` into
    ``local`` (flat from ``lo``): only the file rows that hold some are read, and the values are copied on
    ``local``'s device."""
    owned = (indices >= lo) & (indices < hi)
    has = owned.reshape(owned.shape[0], -1).any(dim=1).nonzero().reshape(-1)
    if not has.numel():
        return
    first, last = int(has[0]), int(has[-1]) + 1
    if entry.shape:
        data = read_tensor(file, entry, range(file_rows.start + first, file_rows.start + last))
    else:
        data = read_tensor(file, entry).reshape(1)
    mine = owned[first:last]
    index = (indices[first:last][mine] - lo).to(local.device)
    local.view(-1).index_copy_(0, index, data[mine].to(device=local.device, dtype=local.dtype))


def _is_range(flat: torch.Tensor) -> bool:
    """Whether indices are consecutive: the file rows are one contiguous block of the model's tensor."""
    first = int(flat[0])
    return int(flat[-1]) == first + flat.numel() - 1 and torch.equal(
        flat, torch.arange(first, first + flat.numel(), dtype=flat.dtype)
    )


def _read_rows(file: Path, entry, rows: range, local: torch.Tensor) -> None:
    """Rows ``rows`` of ``entry`` into ``local``: straight into it when the dtypes match, else through one
    buffer of those rows (a file in another dtype than the model's, cast as from_pretrained casts)."""
    if not entry.shape:
        local.copy_(read_tensor(file, entry).reshape(local.shape))
    elif entry.dtype == local.dtype:
        read_tensor(file, entry, rows, out=local)
    else:
        local.copy_(read_tensor(file, entry, rows))


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds, by clean name, in module order (not rotary embeddings' ``inv_freq``,
    which is not persistent)."""
    out = []
    for prefix, module in model.named_modules():
        for leaf, buffer in module.named_buffers(recurse=False):
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                out.append((clean_name(f"{prefix}.{leaf}" if prefix else leaf), buffer))
    return out


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter that has several (tied embeddings), by each of its names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: group for group in names.values() if len(group) > 1 for name in group}
