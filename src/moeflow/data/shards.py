"""The on-disk format of packed rows: Arrow shards of a tokenized corpus, and how to read and write them.

A corpus folder ``results/{stack}/data/{datakey}/{corpus}/`` holds ``manifest.json`` and one folder per split
(``train``, ``heldout``, ``test``) of Arrow IPC *stream* files ``shard-00000.arrow``, ... (each at most
about ``data.shard_max_bytes``), openable with ``datasets.Dataset.from_file`` and pyarrow. One row is
one packed sequence of ``seq_len`` tokens (only the last row of a split is shorter: its length is
rounded up to a multiple of ``pad_to_multiple_of`` with padding):

- ``input_ids``    list<int32>: token ids; documents are concatenated, each ending with EOS (text
  documents; chat documents end with their template's end token).
- ``labels``       list<int32>: the token to predict at that position (HF convention: the model
  shifts), ``IGNORE_INDEX`` (-100) on padding, on chat tokens outside assistant turns, and at every
  document or segment start, so no token is predicted from another document.
- ``position_ids`` list<int32>: restart at 0 at every document start, at every continuation of a
  document split across rows, and at the padding (one block of its own).
- ``doc_ids``      list<int64>: per token, the document id (first 8 bytes of the SHA-256 of its
  content, as a non-negative int64), ``PAD_DOC_ID`` (-1) on padding.

Use :func:`open_split` (a ``datasets.Dataset``), :func:`iter_rows` (streaming, pyarrow only),
:func:`read_documents` (each document's tokens, reassembled), ``moeflow.data.packing.pack_documents`` and
:func:`write_split` (to write a split of your own in this format), and ``moeflow.data.collate.collate``
to turn rows into model inputs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

IGNORE_INDEX = -100  # a label that is not predicted (also the loss's ignore_index)


PAD_DOC_ID = -1


COLUMNS = ("input_ids", "labels", "position_ids", "doc_ids")


FORMAT_VERSION = 1


SHARD_PATTERN = "shard-{:05d}.arrow"


MANIFEST = "manifest.json"


def row_schema():
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("labels", pa.list_(pa.int32())),
            ("position_ids", pa.list_(pa.int32())),
            ("doc_ids", pa.list_(pa.int64())),
        ]
    )


def _int_array(values: np.ndarray):
    type_ = pa.int64() if values.dtype == np.int64 else pa.int32()
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


def _record_batch(rows: list[Mapping[str, Any]]):
    lengths = np.fromiter((len(r["input_ids"]) for r in rows), dtype=np.int32, count=len(rows))
    offsets = _int_array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    arrays = []
    for name, type_ in zip(COLUMNS, (np.int32, np.int32, np.int32, np.int64)):
        values = np.concatenate([np.asarray(r[name], dtype=type_) for r in rows])
        if len(values) != int(lengths.sum()):
            raise ValueError(f"column {name}: lengths differ from input_ids")
        arrays.append(pa.ListArray.from_arrays(offsets, _int_array(values)))
    return pa.RecordBatch.from_arrays(arrays, schema=row_schema())


class ShardWriter:
    """Write rows to ``out_dir/shard-NNNNN.arrow`` (IPC stream), starting a new shard before one would
    grow past ``shard_max_bytes``. An empty split still gets one (empty) shard."""

    def __init__(self, out_dir: str | os.PathLike, shard_max_bytes: int = 32 << 20):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_max_bytes = int(shard_max_bytes)
        self.batch_bytes = max(1, min(self.shard_max_bytes // 4, 4 << 20))
        self._rows: list[Mapping[str, Any]] = []
        self._buffered = 0
        self._sink = self._writer = None
        self._shard_rows = 0
        self.shards: list[dict[str, Any]] = []

    def write(self, row: Mapping[str, Any]) -> None:
        self._rows.append(row)
        self._buffered += 20 * len(row["input_ids"]) + 16
        if self._buffered >= self.batch_bytes:
            self._flush()

    def write_all(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            self.write(row)

    def _open(self) -> None:
        path = self.out_dir / SHARD_PATTERN.format(len(self.shards))
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, row_schema())
        self.shards.append({"file": path.name, "rows": 0})

    def _close_shard(self) -> None:
        self._writer.close()
        self._sink.close()
        self._writer = self._sink = None

    def _flush(self) -> None:
        if not self._rows:
            return
        batch = _record_batch(self._rows)
        self._rows, self._buffered = [], 0
        if (
            self._writer is not None
            and self.shards[-1]["rows"]
            and self._sink.tell() + batch.nbytes + 1024 > self.shard_max_bytes
        ):
            self._close_shard()
        if self._writer is None:
            self._open()
        self._writer.write_batch(batch)
        self.shards[-1]["rows"] += batch.num_rows

    def close(self) -> list[dict[str, Any]]:
        """Finish the last shard; return ``[{file, rows, bytes, sha256}]``."""
        self._flush()
        if self._writer is None and not self.shards:
            self._open()
        if self._writer is not None:
            self._close_shard()
        for shard in self.shards:
            data = (self.out_dir / shard["file"]).read_bytes()
            shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        return self.shards


def write_split(
    out_dir: str | os.PathLike, rows: Iterable[Mapping[str, Any]], shard_max_bytes: int = 32 << 20
) -> list[dict[str, Any]]:
    """Write rows (dicts with the four columns, lists or arrays) as a split folder of shards."""
    writer = ShardWriter(out_dir, shard_max_bytes)
    writer.write_all(rows)
    return writer.close()


def shard_paths(split_dir: str | os.PathLike) -> list[Path]:
    split_dir = Path(split_dir)
    paths = sorted(split_dir.glob("shard-*.arrow"))
    if not paths:
        raise FileNotFoundError(f"{split_dir}: no shard-*.arrow files; run the tokenize stage first")
    return paths


def open_split(corpus_dir: str | os.PathLike, split: str):
    """One split of a tokenized corpus (``train``, ``heldout``, ``test``, or any folder of shards
    written by :func:`write_split`) as a ``datasets.Dataset``: memory-mapped, shards concatenated."""
    import datasets

    parts = [datasets.Dataset.from_file(str(p)) for p in shard_paths(Path(corpus_dir) / split)]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def iter_batches(source: Any) -> Iterator[Any]:
    """pyarrow RecordBatches of a split folder (streamed shard by shard) or a ``datasets.Dataset``."""
    if isinstance(source, (str, os.PathLike)):
        for path in shard_paths(source):
            with pa.OSFile(str(path), "rb") as fh:
                yield from pa.ipc.open_stream(fh)
    else:
        for table in source.with_format("arrow").iter(batch_size=1024):
            yield from table.select(list(COLUMNS)).combine_chunks().to_batches()


def iter_rows(source: Any) -> Iterator[dict[str, np.ndarray]]:
    """Rows as dicts of numpy arrays, streamed (a split folder or a ``datasets.Dataset``)."""
    for batch in iter_batches(source):
        columns = []
        for name in COLUMNS:
            column = batch.column(name)
            columns.append((name, column.offsets.to_numpy(), column.values.to_numpy()))
        for i in range(batch.num_rows):
            yield {name: values[offsets[i] : offsets[i + 1]] for name, offsets, values in columns}


def read_documents(source: Any) -> Iterator[tuple[int, list[int]]]:
    """``(doc_id, token_ids)`` for each document of a split, in order, reassembled across rows
    (padding dropped; a document's segments are adjacent, so equal adjacent ids are one document)."""
    current_id, tokens = None, []
    for row in iter_rows(source):
        ids, doc_ids, positions = row["input_ids"], row["doc_ids"], row["position_ids"]
        starts = np.flatnonzero(positions == 0).tolist() + [len(ids)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            doc_id = int(doc_ids[lo])
            if doc_id == PAD_DOC_ID:
                continue
            if doc_id != current_id:
                if current_id is not None:
                    yield current_id, tokens
                current_id, tokens = doc_id, []
            tokens.extend(ids[lo:hi].tolist())
    if current_id is not None:
        yield current_id, tokens
