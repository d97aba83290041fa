"""Packing documents into rows of ``seq_len`` tokens, with the result's padding and boundary counts.

The row format is ``moeflow.data.shards``'s; the boundaries counted are those between documents."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moeflow.data.shards import COLUMNS, IGNORE_INDEX, PAD_DOC_ID


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
    def combined(cls, parts: Iterable[PackStats]) -> PackStats:
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
            "padding_fraction": self.max_length_padding_tokens / (self.documents * self.seq_len)
            if self.documents
            else 0.0,
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

    def add(
        self, doc_id: int, ids: Sequence[int] | np.ndarray, labels: Sequence[int] | np.ndarray | None = None
    ) -> list[dict[str, np.ndarray]]:
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
            self._pieces.append(
                (
                    ids[start : start + take],
                    segment_labels,
                    np.arange(take, dtype=np.int32),
                    np.full(take, doc_id, dtype=np.int64),
                )
            )
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
            self._pieces.append(
                (
                    np.full(pad, self.pad_id, dtype=np.int32),
                    np.full(pad, IGNORE_INDEX, dtype=np.int32),
                    np.arange(pad, dtype=np.int32),
                    np.full(pad, PAD_DOC_ID, dtype=np.int64),
                )
            )
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
    """Pack ``(doc_id, token_ids, labels or None)`` into rows (dicts of numpy arrays in ``moeflow.data.shards``'s
    format).

    ``token_ids`` should already end with EOS if the document should; ``labels=None`` means predict
    every token. Document ids should be distinct: ``moeflow.data.shards.read_documents`` joins adjacent equal ids.
    """
    packer = Packer(seq_len, pad_to_multiple_of, pad_id)
    for doc_id, ids, labels in docs:
        yield from packer.add(doc_id, ids, labels)
    yield from packer.finish()
