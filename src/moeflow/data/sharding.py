"""The tokenize stage: one corpus read, split, encoded, packed and written as Arrow shards.

Each split is written with its ``manifest.json`` (the row format: ``moeflow.data.shards``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from moeflow.data.corpus import SPLITS, CorpusError, Document, SourceReader, split_documents
from moeflow.data.packing import Packer, PackStats
from moeflow.data.shards import FORMAT_VERSION, MANIFEST, ShardWriter
from moeflow.data.tokenizer import (
    DocumentEncoder,
    TrainTokenizerStage,
    folder_hash,
    load_fast_tokenizer,
    set_tokenizer_threads,
)
from moeflow.runtime.files import atomic_dir, write_json
from moeflow.runtime.stage import kill_point, progress
from moeflow.settings import plain

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizeStage:
    """Rule tokenize (moeflow.workflow.keys.data_settings): the tokenizer's settings, which the shards depend on
    through its vocabulary, and the config's ``data`` section (sources, split, seq_len, padding, shard size)."""

    tokenizer: TrainTokenizerStage
    data: Mapping[str, Any]


CHUNK_CHARS = 1 << 20  # text per tokenizer batch: bounds memory, and is plenty for Rust's parallelism


CHUNK_DOCS = 4096


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
    settings: TokenizeStage,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    threads: int = 1,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read, split, tokenize and pack one corpus into ``out_dir`` (written atomically); return the manifest."""
    data = settings.data
    if corpus not in data["sources"]:
        raise CorpusError(f"corpus {corpus!r} is not among 'data.sources' ({', '.join(sorted(data['sources']))})")
    source_cfg = data["sources"][corpus]
    set_tokenizer_threads(threads)
    tokenizer = load_fast_tokenizer(tokenizer_path)
    reader = SourceReader(corpus, source_cfg, data["on_bad_record"])
    encoder = DocumentEncoder(tokenizer, reader.source)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (encoder.eos_id or 0)
    seq_len, multiple = int(data["seq_len"]), int(data["pad_to_multiple_of"])

    with atomic_dir(out_dir) as tmp:
        packers = {s: Packer(seq_len, multiple, pad_id) for s in SPLITS}
        writers = {s: ShardWriter(tmp / s, data["shard_max_bytes"]) for s in SPLITS}
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
    log.info(
        "corpus %s: %d documents, %d tokens, padding %.4f%%",
        corpus,
        manifest["totals"]["documents"],
        manifest["totals"]["tokens"],
        100 * manifest["totals"]["padding_fraction"],
    )
    return manifest


def _manifest(
    corpus, settings, tokenizer, tokenizer_path, reader, splits, totals, pad_id, provenance
) -> dict[str, Any]:
    seq_len = settings.data["seq_len"]
    return {
        "corpus": corpus,
        "format": {
            "version": FORMAT_VERSION,
            "shards": "Arrow IPC stream, {train,heldout,test}/shard-NNNNN.arrow",
            "columns": {
                "input_ids": "list<int32>",
                "labels": "list<int32> (-100 ignored)",
                "position_ids": "list<int32> (0 at each document/segment start)",
                "doc_ids": "list<int64> (-1 on padding)",
            },
        },
        "seq_len": seq_len,
        "pad_to_multiple_of": settings.data["pad_to_multiple_of"],
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
        "tokenizer": {
            "sha256": folder_hash(tokenizer_path),
            "vocab_size": len(tokenizer),
            "class": type(tokenizer).__name__,
        },
        "settings": plain(settings),
        "provenance": dict(provenance or {}),
    }
