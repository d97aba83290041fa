"""Tokenizer, packing and the Arrow shard format of the tokenized corpora.

**Row format** (what training, coverage and evaluation read). A corpus folder
``results/{stack}/data/{datakey}/{corpus}/`` holds ``manifest.json`` and one folder per split
(``train``, ``heldout``, ``test``) of Arrow IPC *stream* files ``shard-00000.arrow``, ... (each at most
about ``data.shard_max_bytes``), openable with ``datasets.Dataset.from_file`` and pyarrow. One row is
one packed sequence of ``seq_len`` tokens (only the last row of a split is shorter: its length is
rounded up to a multiple of ``pad_to_multiple_of`` with padding):

- ``input_ids``    list<int32>: token ids; documents are concatenated, each ending with EOS (text
  documents; chat documents end with their template's end token).
- ``labels``       list<int32>: the token to predict at that position (HF convention: the model
  shifts), -100 on padding, on chat tokens outside assistant turns, and at every document or segment
  start, so no token is predicted from another document.
- ``position_ids`` list<int32>: restart at 0 at every document start, at every continuation of a
  document split across rows, and at the padding (one block of its own).
- ``doc_ids``      list<int64>: per token, the document id (first 8 bytes of the SHA-256 of its
  content, as a non-negative int64), -1 on padding.

Use :func:`open_split` (a ``datasets.Dataset``), :func:`iter_rows` (streaming, pyarrow only),
:func:`read_documents` (each document's tokens, reassembled), :func:`pack_documents` and
:func:`write_split` (to write a split of your own in this format), and ``moeflow.collate.collate``
to turn rows into model inputs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .corpus import SPLITS, CorpusError, Document, SourceReader, split_documents
from .files import atomic_dir, write_json
from .stage import kill_point, progress

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
PAD_DOC_ID = -1
COLUMNS = ("input_ids", "labels", "position_ids", "doc_ids")
FORMAT_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.arrow"
MANIFEST = "manifest.json"

# Special tokens of a tokenizer trained here; ChatML turn markers so chat data has a template.
BOS, EOS, PAD = "<|startoftext|>", "<|endoftext|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHUNK_CHARS = 1 << 20  # text per tokenizer batch: bounds memory, and is plenty for Rust's parallelism
CHUNK_DOCS = 4096


# =========================================================================== tokenizer


def set_tokenizer_threads(threads: int) -> None:
    """Let the Rust tokenizer use ``threads`` cores (read once, before its first parallel batch)."""
    os.environ["RAYON_NUM_THREADS"] = str(max(1, int(threads)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def training_texts(settings: Mapping[str, Any]) -> Iterator[str]:
    """The texts a tokenizer is trained on: the TRAIN split of every source (sorted by name).

    Chat documents contribute each message's content (the template's markers are special tokens).
    """
    fractions = settings["split"]
    for name in sorted(settings["sources"]):
        reader = SourceReader(name, settings["sources"][name], settings["on_bad_record"])
        for split, _, doc in split_documents(reader, fractions):
            if split != "train":
                continue
            if doc.messages is not None:
                yield from (m["content"] for m in doc.messages)
            else:
                yield doc.text


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Byte-level BPE trained with the ``tokenizers`` library, wrapped as a PreTrainedTokenizerFast
    (BOS/EOS/PAD and ChatML turn markers as special tokens, a ChatML chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, BOS, PAD, IM_START, IM_END]
    if vocab_size < 256 + len(specials):
        raise CorpusError(f"config key 'tokenizer.vocab_size': {vocab_size} is below the 256 bytes + {len(specials)} special tokens")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(path: str | os.PathLike):
    """A tokenizer folder (trained here, or a pretrained model's), offline; it must be a fast one."""
    from transformers import AutoTokenizer

    if not Path(path, "tokenizer_config.json").is_file() and not Path(path, "tokenizer.json").is_file():
        raise CorpusError(f"{path} is not a tokenizer folder (no tokenizer.json / tokenizer_config.json); point model.pretrained at a model folder with its tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise CorpusError(f"the tokenizer in {path} is not a fast (Rust) tokenizer; save it with tokenizer.json")
    return tokenizer


def folder_hash(path: str | os.PathLike) -> str:
    """SHA-256 over a folder's file names and bytes (sorted): identifies a tokenizer."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


# =========================================================================== packing


@dataclass
class PackStats:
    """Counts of one packed split (all in tokens unless said otherwise)."""

    seq_len: int
    documents: int = 0
    tokens: int = 0
    label_tokens: int = 0
    rows: int = 0
    padding_tokens: int = 0
    split_documents: int = 0
    longest_document: int = 0
    # The usual recipe for comparison: every document padded (or truncated) to max_length = seq_len.
    max_length_padding_tokens: int = 0
    max_length_truncated_tokens: int = 0

    def add_document(self, n: int, labelled: int, rows_spanned: int) -> None:
        self.documents += 1
        self.tokens += n
        self.label_tokens += labelled
        self.split_documents += rows_spanned > 1
        self.longest_document = max(self.longest_document, n)
        self.max_length_padding_tokens += max(0, self.seq_len - n)
        self.max_length_truncated_tokens += max(0, n - self.seq_len)

    @classmethod
    def combined(cls, parts: Iterable["PackStats"]) -> "PackStats":
        parts = list(parts)
        total = cls(seq_len=parts[0].seq_len)
        for name in asdict(total):
            if name != "seq_len":
                values = [getattr(p, name) for p in parts]
                setattr(total, name, max(values) if name == "longest_document" else sum(values))
        return total

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        slots = self.tokens + self.padding_tokens
        out["padding_fraction"] = self.padding_tokens / slots if slots else 0.0
        out["pad_to_max_length"] = {
            "max_length": self.seq_len,
            "padding_fraction": self.max_length_padding_tokens / (self.documents * self.seq_len) if self.documents else 0.0,
            "truncated_fraction": self.max_length_truncated_tokens / self.tokens if self.tokens else 0.0,
        }
        del out["max_length_padding_tokens"], out["max_length_truncated_tokens"]
        return out


class Packer:
    """Packs documents into rows of ``seq_len`` tokens; a document that does not fit continues in the
    next row (a new segment: position 0, label -100). Only :meth:`finish` pads."""

    def __init__(self, seq_len: int, pad_to_multiple_of: int = 64, pad_id: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.seq_len = int(seq_len)
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))
        self.pad_id = int(pad_id)
        self.stats = PackStats(seq_len=self.seq_len)
        self._pieces: list[tuple[np.ndarray, ...]] = []
        self._fill = 0

    def add(self, doc_id: int, ids: Sequence[int] | np.ndarray, labels: Sequence[int] | np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
        """Add one document; return the rows it completed."""
        ids = np.asarray(ids, dtype=np.int32)
        n = len(ids)
        if n == 0:
            return []
        labels = ids.copy() if labels is None else np.array(labels, dtype=np.int32)
        if len(labels) != n:
            raise ValueError(f"document {doc_id}: {len(labels)} labels for {n} tokens")
        labelled = int(np.count_nonzero(labels[1:] != IGNORE_INDEX))  # the first token is never predicted
        rows, start, spanned = [], 0, 0
        while start < n:
            take = min(self.seq_len - self._fill, n - start)
            segment_labels = labels[start : start + take].copy()
            segment_labels[0] = IGNORE_INDEX
            self._pieces.append((
                ids[start : start + take],
                segment_labels,
                np.arange(take, dtype=np.int32),
                np.full(take, doc_id, dtype=np.int64),
            ))
            self._fill += take
            start += take
            spanned += 1
            if self._fill == self.seq_len:
                rows.append(self._emit())
        self.stats.add_document(n, labelled, spanned)
        return rows

    def finish(self) -> list[dict[str, np.ndarray]]:
        """The last, partly filled row, padded to a multiple of ``pad_to_multiple_of`` (at most seq_len)."""
        if not self._fill:
            return []
        m = self.pad_to_multiple_of
        padded = min(self.seq_len, math.ceil(self._fill / m) * m)
        pad = padded - self._fill
        if pad:
            self._pieces.append((
                np.full(pad, self.pad_id, dtype=np.int32),
                np.full(pad, IGNORE_INDEX, dtype=np.int32),
                np.arange(pad, dtype=np.int32),
                np.full(pad, PAD_DOC_ID, dtype=np.int64),
            ))
            self.stats.padding_tokens += pad
        return [self._emit()]

    def _emit(self) -> dict[str, np.ndarray]:
        row = {name: np.concatenate([p[i] for p in self._pieces]) for i, name in enumerate(COLUMNS)}
        self._pieces, self._fill = [], 0
        self.stats.rows += 1
        return row


def pack_documents(
    docs: Iterable[tuple[int, Sequence[int], Sequence[int] | None]],
    seq_len: int,
    pad_to_multiple_of: int = 64,
    pad_id: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Pack ``(doc_id, token_ids, labels or None)`` into rows (dicts of numpy arrays, see the module doc).

    ``token_ids`` should already end with EOS if the document should; ``labels=None`` means predict
    every token. Document ids should be distinct: :func:`read_documents` joins adjacent equal ids.
    """
    packer = Packer(seq_len, pad_to_multiple_of, pad_id)
    for doc_id, ids, labels in docs:
        yield from packer.add(doc_id, ids, labels)
    yield from packer.finish()


# =========================================================================== Arrow shards


def row_schema():
    import pyarrow as pa

    return pa.schema([
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("position_ids", pa.list_(pa.int32())),
        ("doc_ids", pa.list_(pa.int64())),
    ])


def _int_array(values: np.ndarray):
    import pyarrow as pa

    type_ = pa.int64() if values.dtype == np.int64 else pa.int32()
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


def _record_batch(rows: list[Mapping[str, Any]]):
    import pyarrow as pa

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
        import pyarrow as pa

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
        if self._writer is not None and self.shards[-1]["rows"] and self._sink.tell() + batch.nbytes + 1024 > self.shard_max_bytes:
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


def write_split(out_dir: str | os.PathLike, rows: Iterable[Mapping[str, Any]], shard_max_bytes: int = 32 << 20) -> list[dict[str, Any]]:
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
    import pyarrow as pa

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


# =========================================================================== the stage


class DocumentEncoder:
    """Documents to ``(token_ids, labels or None)`` in batches with the Rust tokenizer.

    Text documents get EOS appended and predict every token. Chat documents are rendered with the
    tokenizer's chat template; with ``assistant_only_labels`` (default) only assistant turns
    (without the turn header) have labels.
    """

    def __init__(self, tokenizer: Any, source_cfg: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.assistant_only = bool((source_cfg or {}).get("assistant_only_labels", True))

    def encode(self, docs: Sequence[Document]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        out: list[tuple[np.ndarray, np.ndarray | None] | None] = [None] * len(docs)
        text_index = [i for i, d in enumerate(docs) if d.messages is None]
        encodings = self.backend.encode_batch_fast([docs[i].text for i in text_index], add_special_tokens=False)
        eos = [] if self.eos_id is None else [self.eos_id]
        for i, enc in zip(text_index, encodings):
            out[i] = (np.array(enc.ids + eos, dtype=np.int32), None)
        for i, doc in enumerate(docs):
            if doc.messages is not None:
                out[i] = self.encode_chat(doc)
        return out

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool, origin: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja2 and transformers raise several types for a bad template/record
            raise CorpusError(f"{origin}: the tokenizer's chat template failed on this conversation ({exc}); fix the record or the template") from None

    def encode_chat(self, doc: Document) -> tuple[np.ndarray, np.ndarray]:
        """Render a conversation and label the assistant turns (character spans mapped to tokens)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise CorpusError(f"{doc.origin}: chat data needs a tokenizer with a chat_template; this tokenizer has none")
        messages = list(doc.messages)
        text = self._render(messages, False, doc.origin)
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = np.array(enc.ids, dtype=np.int32)
        if not self.assistant_only:
            return ids, ids.copy()
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:k], True, doc.origin) if k else ""
            upto = self._render(messages[: k + 1], False, doc.origin)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise CorpusError(
                    f"{doc.origin}: the chat template does not render conversations prefix by prefix, so assistant "
                    f"turns cannot be located; set assistant_only_labels: false for this source"
                )
            spans.append((len(before), len(upto)))
        starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(ids))
        keep = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            keep |= (starts >= lo) & (starts < hi)
        return ids, np.where(keep, ids, IGNORE_INDEX).astype(np.int32)


def _chunks(docs: Iterable[tuple[str, int, Document]]) -> Iterator[list[tuple[str, int, Document]]]:
    chunk, chars = [], 0
    for item in docs:
        chunk.append(item)
        doc = item[2]
        chars += len(doc.text) if doc.text is not None else sum(len(m["content"]) for m in doc.messages)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def tokenize_corpus(
    corpus: str,
    settings: Mapping[str, Any],
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    threads: int = 1,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read, split, tokenize and pack one corpus into ``out_dir`` (written atomically); return the manifest.

    ``settings`` is ``moeflow.config.data_settings(cfg)``: ``{"tokenizer": ..., "data": ...}``.
    """
    data = settings["data"]
    if corpus not in data["sources"]:
        raise CorpusError(f"corpus {corpus!r} is not among 'data.sources' ({', '.join(sorted(data['sources']))})")
    source_cfg = data["sources"][corpus]
    set_tokenizer_threads(threads)
    tokenizer = load_tokenizer(tokenizer_path)
    encoder = DocumentEncoder(tokenizer, source_cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (encoder.eos_id or 0)
    reader = SourceReader(corpus, source_cfg, data["on_bad_record"])
    seq_len, multiple = int(data["seq_len"]), int(data.get("pad_to_multiple_of", 64))

    with atomic_dir(out_dir) as tmp:
        packers = {s: Packer(seq_len, multiple, pad_id) for s in SPLITS}
        writers = {s: ShardWriter(tmp / s, data.get("shard_max_bytes", 32 << 20)) for s in SPLITS}
        documents = progress(split_documents(reader, data["split"]), desc=f"tokenize {corpus} (documents)")

        def pack(chunk, encoded) -> None:
            for (split, doc_id, _), (ids, labels) in zip(chunk, encoded.result()):
                writers[split].write_all(packers[split].add(doc_id, ids, labels))
            kill_point("tokenize.chunk")

        # The Rust tokenizer releases the GIL: encode chunk k in a worker while this thread reads
        # chunk k+1 and packs chunk k-1. Order is kept, and at most three chunks are in memory.
        with ThreadPoolExecutor(max_workers=1) as worker:
            previous = None
            for chunk in _chunks(documents):
                encoded = worker.submit(encoder.encode, [d for _, _, d in chunk])
                if previous:
                    pack(*previous)
                previous = (chunk, encoded)
            if previous:
                pack(*previous)
        splits = {}
        for s in SPLITS:
            writers[s].write_all(packers[s].finish())
            splits[s] = packers[s].stats.summary() | {"shards": writers[s].close()}
        totals = PackStats.combined(packers[s].stats for s in SPLITS).summary()
        manifest = _manifest(corpus, settings, tokenizer, tokenizer_path, reader, splits, totals, pad_id, provenance)
        write_json(tmp / MANIFEST, manifest)
        kill_point("tokenize.before_rename")
    log.info("corpus %s: %d documents, %d tokens, padding %.4f%%", corpus, manifest["totals"]["documents"],
             manifest["totals"]["tokens"], 100 * manifest["totals"]["padding_fraction"])
    return manifest


def _manifest(corpus, settings, tokenizer, tokenizer_path, reader, splits, totals, pad_id, provenance) -> dict[str, Any]:
    seq_len = settings["data"]["seq_len"]
    return {
        "corpus": corpus,
        "format": {
            "version": FORMAT_VERSION,
            "shards": "Arrow IPC stream, {train,heldout,test}/shard-NNNNN.arrow",
            "columns": {"input_ids": "list<int32>", "labels": "list<int32> (-100 ignored)",
                        "position_ids": "list<int32> (0 at each document/segment start)",
                        "doc_ids": "list<int64> (-1 on padding)"},
        },
        "seq_len": seq_len,
        "pad_to_multiple_of": settings["data"].get("pad_to_multiple_of", 64),
        "pad_id": pad_id,
        "eos_id": tokenizer.eos_token_id,
        "splits": splits,
        "totals": totals,
        "read": {
            "documents": reader.documents_read,
            "empty_documents": reader.empty_documents,
            "duplicate_documents": reader.duplicate_documents,
            "skipped_records": reader.skipped(),
        },
        "source": reader.fingerprint(),
        "tokenizer": {"sha256": folder_hash(tokenizer_path), "vocab_size": len(tokenizer), "class": type(tokenizer).__name__},
        "settings": settings,
        "provenance": dict(provenance or {}),
    }


def train_tokenizer_stage(settings: Mapping[str, Any], out_dir: str | os.PathLike, threads: int = 1,
                          provenance: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Train the tokenizer of a model built from config and save it (atomically) as a tokenizer folder,
    with ``moeflow_tokenizer.json`` saying what it was trained on."""
    set_tokenizer_threads(threads)
    tok_cfg = settings["tokenizer"]
    counter = {"texts": 0, "chars": 0}

    def counted(texts: Iterable[str]) -> Iterator[str]:
        for text in progress(texts, desc="train tokenizer (texts)"):
            counter["texts"] += 1
            counter["chars"] += len(text)
            yield text

    tokenizer = train_tokenizer(counted(training_texts(settings)), int(tok_cfg["vocab_size"]), int(tok_cfg.get("min_frequency", 2)))
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(str(tmp))
        info = {"trained_on": counter, "vocab_size": len(tokenizer), "settings": settings, "provenance": dict(provenance or {})}
        write_json(tmp / "moeflow_tokenizer.json", info)
        kill_point("train_tokenizer.before_rename")
    return info
