"""Safetensors files read and written one tensor at a time, so no process holds a file's tensors twice.

``safetensors.torch.save_file`` turns every tensor into a bytes copy before it writes, and ``load_file``
reads every tensor of a file; a rank that owns a slice of a tensor needs neither. The format is simple
(an 8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}`` plus
``__metadata__``, then the tensors' bytes back to back), so:

* :class:`SafetensorsWriter` writes the header from a layout given in advance (names, dtypes, shapes),
  then each tensor's bytes as it arrives (from the device one tensor at a time);
* :func:`read_header` / :func:`read_tensor` / :func:`read_elements` read the header, then a tensor, a range
  of its dim-0 rows or of its flattened elements with ``os.pread`` straight into the destination's memory
  (no mmap: the pages a rank touches would count against it while the file stays open);
* :func:`weight_files` maps every tensor of a model folder (one ``model.safetensors``, or an HF index
  ``model.safetensors.index.json`` with its files) to the file holding it.

The files are the format ``safetensors`` itself reads and writes (tests check both directions).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"


SINGLE_FILE = "model.safetensors"


HEADER_ALIGNMENT = 8  # safetensors pads its header so that the data starts 8-byte aligned


METADATA_KEY = "__metadata__"


DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code


CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class SafetensorsError(ValueError):
    """A safetensors file or model folder that cannot be read as asked, naming the file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its name, dtype, shape and absolute byte range in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for a 0-d tensor)."""
        return tensor_nbytes(self.dtype, self.shape[1:]) if self.shape else self.end - self.start


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _dtype_code(dtype: torch.dtype, name: str) -> str:
    if dtype not in DTYPE_CODES:
        raise SafetensorsError(f"tensor {name!r}: dtype {dtype} has no safetensors code")
    return DTYPE_CODES[dtype]


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file by name, and its ``__metadata__``."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path} is not a safetensors file: it is shorter than its header length")
        (length,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if length > size - 8:
            raise SafetensorsError(f"{path} is not a safetensors file (or is cut short): its header is {length} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise SafetensorsError(f"{path}: the safetensors header is not JSON ({exc})") from None
    data_start = 8 + length
    metadata = header.pop(METADATA_KEY, None) or {}
    entries = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in CODE_DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which torch here cannot hold")
        if data_start + end > size:
            raise SafetensorsError(f"{path} is cut short: tensor {name!r} ends past the end of the file")
        entries[name] = TensorEntry(
            name, CODE_DTYPES[info["dtype"]], tuple(info["shape"]), data_start + begin, data_start + end
        )
    return entries, metadata


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A CPU contiguous tensor's memory as bytes, without a copy (any dtype, bf16 included)."""
    flat = tensor.reshape(-1) if tensor.dim() == 0 else tensor
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def read_tensor(
    path: str | os.PathLike, entry: TensorEntry, rows: range | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``entry``'s tensor, or its dim-0 rows ``rows`` (a step-1 range), read from ``path`` into ``out``
    (a contiguous tensor of that shape and dtype, on any device) or into a new CPU tensor."""
    rows = rows if rows is not None else range(entry.shape[0] if entry.shape else 1)
    if rows.step != 1 or rows.start < 0 or (entry.shape and rows.stop > entry.shape[0]):
        raise SafetensorsError(f"{path}: rows {rows} of tensor {entry.name!r} of shape {list(entry.shape)}")
    shape = (len(rows), *entry.shape[1:]) if entry.shape else ()
    if out is not None and (tuple(out.shape) != shape or out.dtype != entry.dtype):
        raise SafetensorsError(
            f"{path}: tensor {entry.name!r} rows {rows.start}:{rows.stop} are {entry.dtype} {list(shape)}, "
            f"but the destination is {out.dtype} {list(out.shape)}"
        )
    return _read_bytes_into(path, entry, entry.start + rows.start * entry.row_bytes, shape, out)


def read_elements(path: str | os.PathLike, entry: TensorEntry, start: int, stop: int, out: torch.Tensor) -> None:
    """Elements ``start:stop`` of ``entry``'s flattened tensor into the 1-D ``out`` (FSDP1's flat shards
    hold such ranges of the parameters, which need not start on a row)."""
    numel = math.prod(entry.shape)
    if not 0 <= start <= stop <= numel or out.dtype != entry.dtype or tuple(out.shape) != (stop - start,):
        raise SafetensorsError(
            f"{path}: elements {start}:{stop} of tensor {entry.name!r} ({entry.dtype}, {numel} elements) "
            f"into a destination of {out.dtype} {list(out.shape)}"
        )
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    _read_bytes_into(path, entry, entry.start + start * itemsize, (stop - start,), out)


def _read_bytes_into(
    path: str | os.PathLike, entry: TensorEntry, offset: int, shape: tuple[int, ...], out: torch.Tensor | None
) -> torch.Tensor:
    """The bytes at ``offset`` of a tensor of ``shape`` (``entry``'s dtype), straight into ``out`` when it is a
    contiguous CPU tensor, else through one buffer."""
    target = out if out is not None and out.device.type == "cpu" and out.is_contiguous() else None
    buffer = target if target is not None else torch.empty(shape, dtype=entry.dtype)
    view = _byte_view(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(f"{path} is cut short inside tensor {entry.name!r}")
            done += n
    finally:
        os.close(fd)
    if out is not None and target is None:
        out.copy_(buffer)
        return out
    return buffer


class SafetensorsWriter:
    """Write a safetensors file whose tensors arrive one at a time, in the order of ``layout``.

    ``layout``: ``(name, dtype, shape)`` of every tensor, known before the first byte is written (the
    header comes first). Use as a context manager; the file is complete when the block ends without an
    error and every tensor was written (else :class:`SafetensorsError`; the caller's atomic folder
    discards the partial file)."""

    def __init__(
        self,
        path: str | os.PathLike,
        layout: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(path)
        self.layout = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in layout]
        names = [name for name, _, _ in self.layout]
        if len(set(names)) != len(names):
            raise SafetensorsError(f"{self.path}: a tensor name appears twice in the layout")
        header: dict[str, object] = {}
        if metadata:
            header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in self.layout:
            size = tensor_nbytes(dtype, shape)
            header[name] = {
                "dtype": _dtype_code(dtype, name),
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
        self._header = struct.pack("<Q", len(encoded)) + encoded
        self.data_bytes = offset
        self._next = 0
        self._file = None

    def __enter__(self) -> SafetensorsWriter:
        self._file = self.path.open("wb")
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the layout (moved to the CPU here if it is on a device)."""
        if self._next >= len(self.layout):
            raise SafetensorsError(f"{self.path}: tensor {name!r} is beyond the layout's {len(self.layout)} tensors")
        expected, dtype, shape = self.layout[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise SafetensorsError(
                f"{self.path}: expected tensor {expected!r} ({dtype} {list(shape)}) next, "
                f"got {name!r} ({tensor.dtype} {list(tensor.shape)})"
            )
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            self._file.write(_byte_view(data))
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        if exc_type is None and self._next != len(self.layout):
            missing = [name for name, _, _ in self.layout[self._next :]]
            raise SafetensorsError(f"{self.path}: {len(missing)} tensor(s) never written, from {missing[0]!r}")


def weight_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Every tensor name of a model folder mapped to the file holding it: from the HF index
    (``model.safetensors.index.json``) when there is one, else from the single ``model.safetensors``."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as exc:
            raise SafetensorsError(f"{index}: not an HF safetensors index with a weight_map ({exc})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise SafetensorsError(f"{index} names file(s) the folder lacks: {', '.join(missing)}")
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        return {name: single for name in read_header(single)[0]}
    raise SafetensorsError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors model folder")
