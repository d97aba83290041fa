"""Sets of flags packed 64 to a uint64 word, with vectorised popcounts.

Bit ``c % 64`` of word ``c // 64`` is flag c; the popcounts stay vectorised over many rows of words."""

from __future__ import annotations

import numpy as np

WORD = 64


_SHIFTS = np.arange(WORD, dtype=np.uint64)


def _popcount_swar(x: np.ndarray) -> np.ndarray:
    """Set bits per uint64 (numpy < 2 has no bitwise_count), in place on a copy."""
    x = x.copy()
    t = x >> np.uint64(1)
    t &= np.uint64(0x5555555555555555)
    x -= t
    t = x >> np.uint64(2)
    t &= np.uint64(0x3333333333333333)
    x &= np.uint64(0x3333333333333333)
    x += t
    x += x >> np.uint64(4)
    x &= np.uint64(0x0F0F0F0F0F0F0F0F)
    x *= np.uint64(0x0101010101010101)
    x >>= np.uint64(56)
    return x


popcount = getattr(np, "bitwise_count", _popcount_swar)


def masked_popcounts(
    words: np.ndarray, mask: np.ndarray, docs: np.ndarray | None = None, chunk: int = 8192
) -> np.ndarray:
    """Set bits of ``words[doc] & mask`` for each document (all, or ``docs``), in bounded memory."""
    columns = np.flatnonzero(mask)
    docs = np.arange(words.shape[0]) if docs is None else np.asarray(docs)
    out = np.zeros(len(docs), dtype=np.int64)
    if columns.size == 0:
        return out
    sub_mask = mask[columns]
    for start in range(0, len(docs), chunk):
        block = words[docs[start : start + chunk]][:, columns]
        block &= sub_mask
        out[start : start + chunk] = popcount(block).sum(axis=1, dtype=np.int64)
    return out


def unpack_word_bits(row: np.ndarray, num_bits: int) -> np.ndarray:
    """Booleans of a (W,) uint64 bit row: bit ``c % 64`` of word ``c // 64`` is entry c."""
    return ((row[:, None] >> _SHIFTS) & np.uint64(1)).astype(bool).reshape(-1)[:num_bits]


def pack_word_bits(flags: np.ndarray) -> np.ndarray:
    """(..., C) booleans to (..., ceil(C / 64)) uint64 (the inverse of ``unpack_word_bits``)."""
    flags = np.asarray(flags, dtype=bool)
    pad = (-flags.shape[-1]) % WORD
    if pad:
        flags = np.concatenate([flags, np.zeros(flags.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    grouped = flags.reshape(flags.shape[:-1] + (-1, WORD)).astype(np.uint64)
    return (grouped << _SHIFTS).sum(axis=-1, dtype=np.uint64)


def column_bit_counts(words: np.ndarray, rows: np.ndarray, num_bits: int, chunk: int = 1024) -> np.ndarray:
    """(num_bits,) how many of the rows ``rows`` of ``words`` (R, W) have each bit set."""
    counts = np.zeros(words.shape[1] * WORD, dtype=np.int64)
    for start in range(0, len(rows), chunk):
        sub = words[rows[start : start + chunk]]  # (n, W)
        counts += ((sub[:, :, None] >> _SHIFTS) & np.uint64(1)).sum(axis=0, dtype=np.int64).reshape(-1)
    return counts[:num_bits]
