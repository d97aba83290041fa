"""Packed rows in the data stage's format for the benchmarks: two documents a row (positions restart at the
second, -100 at each document's first label), random ids. Torch only, no moeflow: the scale benchmark imports it
under an older moeflow (its baseline design) as well."""

from __future__ import annotations

import torch


def two_document_rows(n: int, seq_len: int, vocab: int, seed: int = 0, cut: int | None = None) -> list[dict]:
    """``n`` rows of ``seq_len`` ids in ``[3, vocab)``; the second document starts at ``cut``, or at a position
    drawn per row from the middle half when ``cut`` is None."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(n):
        start = int(torch.randint(seq_len // 4, 3 * seq_len // 4, (1,), generator=g)) if cut is None else cut
        ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
        labels = list(ids)
        labels[0] = labels[start] = -100
        rows.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": list(range(start)) + list(range(seq_len - start)),
                "doc_ids": [2 * r] * start + [2 * r + 1] * (seq_len - start),
            }
        )
    return rows
