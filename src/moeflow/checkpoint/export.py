"""The final model folder, HF-sharded safetensors written one whole tensor at a time by every rank.

The folder (safetensors, config, tokenizer) is written by every rank together, so that no process ever holds the
whole model.

:func:`save_final_model` is a collective for a sharded model (every rank calls it): each tensor is made
whole in turn on rank 0 alone (DTensors split along dim 0 only, FSDP2's shards and transformers'
expert-parallel 2-D layouts: the first rank holding each row sends it, run of rows by run, received one run at
a time into host memory; FSDP1: the ranks' ranges of its elements summed into one buffer on rank 0; any other
DTensor: ``DTensor.full_tensor`` on every rank), and rank 0 streams it into the open
shard file (``moeflow.model.safetensors_files.SafetensorsWriter``: the layout is known in advance from the
tensors' whole shapes and dtypes). A file is closed when the next tensor would take it past
``export.max_shard_size`` (a tensor larger than that gets a file of its own, as ``save_pretrained`` does);
one file is ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``. The weights are what ``save_pretrained`` writes on this stack: its
names and layout (``moeflow.model.saved_names``: a family's published names where moeflow registers its key
mapping, Step-3.5-Flash's ``moe.*`` stacked experts), tied weights once, persistent buffers, MTP layers
included. Next to them, a fine-tuned model gets its base folder's own files (``source``: the config.json as
it was, legacy keys and all, which serving engines read, but for its ``torch_dtype``, which names the dtype
written; the tokenizer with its chat template, the generation config and whatever else the folder ships
besides weights), so the folder drops in for the one it came from; without a source, ``config.json`` and
``generation_config.json`` from the model (a cache for generation; the run's ``distributed_config``
dropped) and the tokenizer. An unsharded model (every rank holds it whole) is written by rank 0 alone, no
collective. A LoRA model is written merged, one weight at a time as the rest: an adapted weight made whole, its
adapter's factors gathered, their update (``moeflow.model.lora_merge.MergeTarget``) added in fp32 (a fused expert tensor
one expert at a time) and the sum rounded once to the dtype written; the model keeps its adapters.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from moeflow.checkpoint.dense_export import write_dense_architecture
from moeflow.checkpoint.pieces import state_pieces
from moeflow.checkpoint.storage import Piece
from moeflow.model.folder import PICKLE_WEIGHTS
from moeflow.model.lora import is_lora_model
from moeflow.model.lora_merge import MergeTarget, merge_targets
from moeflow.model.parameters import base_name, clean_name, is_adapter
from moeflow.model.quantization import quantized_weights, unpack
from moeflow.model.safetensors_files import INDEX_FILE, SINGLE_FILE, SafetensorsWriter, tensor_nbytes
from moeflow.model.saved_names import saved_format
from moeflow.model.wrappers import is_fsdp1, unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.layouts import is_sharded, original_shape, reshard
from moeflow.parallel.process_group import barrier, exact_sum_view, rank
from moeflow.parallel.rank_load import global_rows, persistent_buffers
from moeflow.runtime.files import atomic_dir

SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(ValueError):
    """A final model that cannot be written as asked."""


def size_in_bytes(size: int | str) -> int:
    """``export.max_shard_size`` in bytes: an int, or a number with a unit as save_pretrained takes it
    ("5GB" = 5 x 10^9 bytes, "200KB", "1GiB" = 2^30)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if not match:
        raise ExportError(f"export.max_shard_size {size!r} is not a size such as 5GB, 500MB or 1GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


@dataclass(frozen=True)
class ModelTensor:
    """One tensor the folder holds, by the unwrapped model's name, with its whole dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def model_tensors(model: torch.nn.Module) -> list[ModelTensor]:
    """Every parameter (tied ones once, under the first name, as save_pretrained keeps them) and persistent
    buffer of the model, in module order; a LoRA model's base weights under the base model's names, without
    the adapters; a quantized weight in its compute dtype and shape (moeflow.model.quantization)."""
    quantized = quantized_weights(model)
    out = []
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        name = base_name(clean_name(name))
        dense = quantized[name].dequantize if name in quantized else None
        out.append(
            ModelTensor(name, dense.dtype, dense.packing.shape)
            if dense
            else ModelTensor(name, p.dtype, original_shape(p))
        )
    return out + [ModelTensor(base_name(name), b.dtype, tuple(b.shape)) for name, b in persistent_buffers(model)]


def whole_tensors(model: torch.nn.Module, tensors: Sequence[ModelTensor]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each of ``tensors`` whole, one at a time, in order: on every rank (DTensors: ``full_tensor``), or,
    for FSDP1, on rank 0 (None on the others) from the ranks' ranges of its elements in their flat shards
    (``moeflow.checkpoint.pieces.state_pieces``; torch 2.3's ``summon_full_params`` of one inner unit leaves its
    parameters sharded, and its sharded state dict copies every rank's rows at once). A collective for a
    sharded model: every rank iterates to the end."""
    if is_fsdp1(model):
        pieces = state_pieces(model).model
        params = {clean_name(n) for n, _ in unwrap(model).named_parameters()}
        for t in tensors:
            piece = pieces[t.name]
            yield t.name, (_whole_on_rank0(piece, t) if t.name in params else piece.local.view(t.shape))
        return
    lookup = {base_name(clean_name(n)): t for n, t in model.named_parameters() if not is_adapter(n)}
    lookup |= {base_name(clean_name(n)): b for n, b in model.named_buffers()}
    quantized = quantized_weights(model)
    for t in tensors:
        tensor = lookup[t.name]
        whole = _rows_on_rank0(tensor) if _rows_over_all_ranks(tensor) else _whole(tensor)
        if t.name in quantized and whole is not None:  # its stored bytes, dequantized
            dense = quantized[t.name].dequantize
            whole = unpack(dense.packing, whole, dense.dtype)
        yield t.name, whole


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor
    return (full_tensor() if full_tensor is not None else tensor).detach()


def _rows_over_all_ranks(tensor: torch.Tensor) -> bool:
    """A DTensor split along dim 0 only (FSDP2's shards; transformers' expert parallelism over FSDP2, a 2-D
    mesh): gathered on rank 0 alone, its rows sent by the ranks that hold them."""
    import torch.distributed as dist

    if not dtensors.is_dtensor(tensor) or not dist.is_initialized() or not tensor.dim():
        return False
    return all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in tensor.placements)


def _rows_on_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """A row-sharded DTensor whole in rank 0's host memory (None on the other ranks): the ranks learn which
    whole rows each holds (``moeflow.parallel.rank_load.global_rows``), the first rank holding a row sends it,
    run of consecutive rows by run, and rank 0 receives one run at a time into a buffer of that run on its
    device and copies it into place, so no rank holds the whole tensor on its device (12 GB for one fused
    expert tensor of Step-3.5-Flash) and the others hold nothing more than their shard."""
    import torch.distributed as dist

    local = tensor.to_local().detach()
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, global_rows(tensor))
    owner: dict[int, int] = {}
    for r, held in enumerate(every):
        for row in held:
            owner.setdefault(row, r)
    me = dist.get_rank()
    if me != 0:
        for first, stop in _sent_runs(every[me], owner, me):
            dist.send(local[first:stop].contiguous(), dst=0)
        return None
    whole = torch.empty(tuple(tensor.shape), dtype=local.dtype, device="cpu")
    for r, held in enumerate(every):
        for first, stop in _sent_runs(held, owner, r):
            if r == 0:
                piece = local[first:stop]
            else:
                piece = torch.empty((stop - first, *tensor.shape[1:]), dtype=local.dtype, device=local.device)
                dist.recv(piece, src=r)
            whole[held[first] : held[first] + stop - first].copy_(piece)
    return whole


def _sent_runs(held: list[int], owner: dict[int, int], rank: int) -> list[tuple[int, int]]:
    """The local row ranges (start, stop) rank ``rank`` sends: its runs of consecutive whole rows it is the
    first holder of."""
    runs: list[tuple[int, int]] = []
    for i, row in enumerate(held):
        if owner[row] != rank:
            continue
        if runs and runs[-1][1] == i and held[i - 1] == row - 1:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _whole_on_rank0(piece: Piece, tensor: ModelTensor) -> torch.Tensor | None:
    """An FSDP1 parameter whole on rank 0: each rank puts its range of elements into a zero buffer of the
    whole and the buffers are summed on rank 0 as integers (``exact_sum_view``: every element comes from one
    rank and the others add zero bits: the exact values, a negative zero's sign too)."""
    import torch.distributed as dist

    whole = torch.zeros(piece.numel, dtype=tensor.dtype, device=piece.local.device)
    whole[piece.offset : piece.offset + piece.local.numel()] = piece.local
    dist.reduce(exact_sum_view(whole), dst=0, op=dist.ReduceOp.SUM)  # NCCL has no int16: 2-byte masters as bytes
    return whole.view(tensor.shape) if rank() == 0 else None


def shard_layouts(
    saved: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int
) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """The files' layouts, in order: a file takes tensors until the next would pass ``max_shard_size``
    bytes; a tensor larger than that on its own."""
    files: list[list] = [[]]
    size = 0
    for spec in saved:
        nbytes = tensor_nbytes(spec[1], spec[2])
        if files[-1] and (size + nbytes > max_shard_size or nbytes > max_shard_size):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += nbytes
        if nbytes > max_shard_size:
            files.append([])
            size = 0
    return [f for f in files if f]


def file_names(count: int) -> list[str]:
    """save_pretrained's weight file names for ``count`` files."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardedWriter:
    """Writes tensors into consecutive safetensors files of known layouts, one file open at a time."""

    METADATA = {"format": "pt"}  # what save_pretrained writes, and what from_pretrained checks

    def __init__(self, folder: Path, layouts: list[list[tuple[str, torch.dtype, tuple[int, ...]]]]):
        self.folder = folder
        self.layouts = layouts
        self.names = file_names(len(layouts))
        self._file = -1
        self._left = 0
        self._writer: SafetensorsWriter | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._left == 0:
            self._close()
            self._file += 1
            if self._file >= len(self.layouts):
                raise ExportError(f"{self.folder}: tensor {name!r} is beyond the planned files")
            path = self.folder / self.names[self._file]
            self._writer = SafetensorsWriter(path, self.layouts[self._file], self.METADATA).__enter__()
            self._left = len(self.layouts[self._file])
        self._writer.write(name, tensor)
        self._left -= 1

    def _close(self, exc: BaseException | None = None) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.__exit__(type(exc) if exc else None, exc, None)

    def finish(self) -> None:
        self._close()
        if self._file != len(self.layouts) - 1 or self._left:
            raise ExportError(f"{self.folder}: the model's tensors ended before the planned files were written")
        if len(self.layouts) > 1:
            weight_map = {spec[0]: file for file, layout in zip(self.names, self.layouts) for spec in layout}
            total = sum(tensor_nbytes(dtype, shape) for layout in self.layouts for _, dtype, shape in layout)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_dtype(setting: str, source: str | os.PathLike | None, model: torch.nn.Module) -> torch.dtype:
    """The final model's floating-point dtype for ``export.dtype``: as set, or (``auto``) the ``source`` folder's
    own (its config.json's ``torch_dtype``/``dtype``: the published model's), else the model's parameters'."""
    if setting != "auto":
        return EXPORT_DTYPES[setting]
    if source is not None and (Path(source) / "config.json").is_file():
        config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
        named = config.get("torch_dtype") or config.get("dtype")
        if isinstance(named, str) and isinstance(getattr(torch, named, None), torch.dtype):
            dtype = getattr(torch, named)
            if dtype.is_floating_point:
                return dtype
    return next(unwrap(model).parameters()).dtype


def _cast(dtype: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    return to if to is not None and dtype.is_floating_point else dtype


def write_weights(
    model: torch.nn.Module, folder: Path | None, max_shard_size: int | str, dtype: torch.dtype | None = None
) -> None:
    """The model's weights as save_pretrained writes them, streamed into ``folder`` by rank 0 (the other
    ranks pass None), floating-point ones in ``dtype`` (None: their own); a LoRA model's merged. A collective for
    a sharded model."""
    if folder is None and not is_sharded(model):  # every rank holds it whole: rank 0 writes it alone
        return
    inner = unwrap(model, peft=True)
    tensors = model_tensors(model)
    adapted = {target.name: target for target in merge_targets(model)} if is_lora_model(model) else {}
    saved = []
    for t in tensors:
        for name, meta in saved_format(inner, {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta")}).items():
            saved.append((name, _cast(meta.dtype, dtype), tuple(meta.shape)))
    writer = ShardedWriter(folder, shard_layouts(saved, size_in_bytes(max_shard_size))) if folder else None
    try:
        for name, whole in whole_tensors(model, tensors):
            if name in adapted:
                whole = merged(adapted[name], whole, dtype)
            if writer is not None:
                for saved_name, piece in saved_format(inner, {name: whole}).items():
                    writer.write(saved_name, piece.to(_cast(piece.dtype, dtype)))
            del whole
    except BaseException as exc:
        if writer is not None:
            writer._close(exc)
        raise
    if writer is not None:
        writer.finish()


def merged(target: MergeTarget, whole: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The base weight ``whole`` (None off rank 0 for a sharded model) plus its adapter's update, in ``dtype`` (None:
    the weight's own). The factors are gathered on every rank (a collective for a sharded model); the sum is
    made in fp32 and a fused expert tensor one expert at a time, beside the weight rather than in it (an
    unsharded model's ``whole`` is its own parameter)."""
    a, b = _whole(target.lora_a), _whole(target.lora_b)
    if whole is None:
        return None
    out = torch.empty(whole.shape, dtype=_cast(whole.dtype, dtype))
    if target.experts == 1:
        return out.copy_(whole.float() + target.delta(a, b).to(whole.device))
    for expert in range(target.experts):
        out[expert] = whole[expert].float() + target.delta(a, b, expert).to(whole.device)
    return out


def _saved_config(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """The model's config as the folder holds it: generation with a cache (training turned it off), and
    no DistributedConfig (the folder loads whole; the layout is the run's, not the model's)."""
    inner = unwrap(model, peft=True)
    config = copy.deepcopy(inner.config)
    config.use_cache = True
    config.architectures = [type(inner).__name__.removeprefix("FSDP")]  # as save_pretrained records them
    config.dtype = str(dtype or next(inner.parameters()).dtype).split(".")[1]
    if getattr(config, "distributed_config", None) is not None:
        config.distributed_config = None
    return config


def companion_files(source: str | os.PathLike) -> list[Path]:
    """A model folder's own files besides its weights (top level): config.json, the tokenizer's files and chat
    template, generation_config.json, and anything else it ships (a README, its remote code)."""
    weights = {
        INDEX_FILE,
        *(p.name for pattern in ("*.safetensors", *PICKLE_WEIGHTS) for p in Path(source).glob(pattern)),
    }
    return sorted(p for p in Path(source).iterdir() if p.is_file() and p.name not in weights)


def write_model_folder(
    model: torch.nn.Module,
    tokenizer: Any,
    folder: str | os.PathLike | None,
    max_shard_size: int | str,
    source: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """The model's weights into an existing folder (rank 0's; the other ranks pass None), in ``dtype`` (None:
    their own), and with them the ``source`` folder's own files (:func:`companion_files`), or without a source
    the model's config and generation config and (if given) the tokenizer. A collective for a sharded model."""
    folder = Path(folder) if folder is not None else None
    write_weights(model, folder, max_shard_size, dtype)
    if folder is None:
        return
    if source is not None:
        for file in companion_files(source):
            shutil.copy2(file, folder / file.name)
        if dtype is not None and (folder / "config.json").is_file():
            _name_dtype(folder / "config.json", dtype)
        return
    inner = unwrap(model, peft=True)
    _saved_config(model, dtype).save_pretrained(folder)
    generation = getattr(inner, "generation_config", None)
    if generation is not None and inner.can_generate():
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _name_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """The copied config.json naming the dtype the weights were written in (``torch_dtype``, and ``dtype``
    where the source has it: transformers 5's key), every other key as the source has it."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    if all(config[k] == name for k in keys if k in config):
        return
    config.update(dict.fromkeys(keys, name))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_final_model(
    model: Any,
    tokenizer: Any,
    folder: str | os.PathLike,
    max_shard_size: int | str,
    source: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """A folder that AutoModelForCausalLM/AutoTokenizer.from_pretrained load, written atomically by rank 0
    (a LoRA model's adapters merged into the weights written), with the ``source`` folder's own files where given
    (the base model a fine-tune started from: :func:`write_model_folder`), its floating-point weights in ``dtype``
    (:func:`export_dtype`; None: their own). A model with no MoE layer is written as its family's dense architecture
    (moeflow.checkpoint.dense_export). A collective: every rank calls it."""
    reshard(model)  # the parameters as their shards, also after a last evaluation's forward
    with atomic_dir(folder) if rank() == 0 else contextlib.nullcontext() as out:
        write_model_folder(model, tokenizer, out, max_shard_size, source, dtype)
        if out is not None:
            write_dense_architecture(out, unwrap(model, peft=True))
    barrier()  # the folder is in place before any rank goes on


@dataclass(frozen=True)
class ExportSettings:
    """``export``: the final model folder (moeflow.checkpoint.export)."""

    SCHEMA: ClassVar[str] = "#/properties/export"
    max_shard_size: str
    dtype: str
