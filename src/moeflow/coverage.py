"""The expert-coverage validation set: per-document routing statistics, greedy multi-cover, random comparison.

1. **Statistics** (``route_pool``): the held-out pool goes through the base model in batches of about
   ``batch_tokens`` tokens (no grad, packed documents masked from each other by ``moeflow.collate``);
   ``moeflow.routing.capture`` gives each token's chosen experts and the row column ``doc_ids``
   attributes it to its document. Kept per document, sparse: tokens routed to each (layer, expert)
   and tokens on which each pair of experts was chosen together (``PoolStats``). Memory grows with the
   number of distinct (document, layer, expert) and (document, layer, pair) entries, never with
   tokens x experts.
2. **Constraints** (``build_constraints``): one per (layer, expert), plus the ``pairs_per_layer`` most
   frequent pairs of each layer. A document *meets* a constraint if at least ``min_tokens`` of its
   tokens were routed there. Kept as packed bits: bit ``c % 64`` of ``words[c // 64, doc]``.
3. **Selection** (``select_documents``): greedy multi-cover within the token budget; each constraint
   needs ``min_docs_per_expert`` documents. The greedy picks the document with the most still-needed
   constraints per token: a lazy greedy over the packed bits (scores only fall as constraints are met,
   so only the highest stale scores are recounted, vectorised in blocks), with no loop over documents
   x experts. Ties go to a seeded random
   rank. Then the budget is filled with random documents so that each pool corpus keeps its share of
   tokens. Constraints the pool cannot meet fail the stage (``CoverageInfeasible``) unless
   ``coverage.allow_unmet`` records them.
4. **Comparison** (``random_comparison``): random subsets of the same token count; how many cells and
   pairs they leave below the threshold.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .collate import MODEL_INPUTS
from .files import atomic_dir, read_json, write_json

log = logging.getLogger(__name__)

VALSET_SPLIT = "heldout"  # the validation set is a corpus folder whose one split holds held-out documents
ALLOW_UNMET_KEY = "coverage.allow_unmet"


class CoverageInfeasible(RuntimeError):
    """Constraints no selection can meet (from the pool, or within the token budget)."""


# =========================================================================== statistics


@dataclass
class Sparse:
    """Per-document counts: ``count[i]`` tokens of document ``doc[i]`` on constraint code ``code[i]``."""

    doc: np.ndarray
    code: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls) -> "Sparse":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy())


def _sum_duplicates(doc: np.ndarray, code: np.ndarray, count: np.ndarray, width: int) -> Sparse:
    """Merge entries with the same (doc, code), sorted by doc then code."""
    if doc.size == 0:
        return Sparse.empty()
    key = doc.astype(np.int64) * width + code
    order = np.argsort(key, kind="stable")
    key = key[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    merged = np.add.reduceat(count[order].astype(np.int64), starts)
    key = key[starts]
    return Sparse(key // width, key % width, merged)


@dataclass
class PoolStats:
    """Routing statistics of a document pool (one entry per document, in pool order)."""

    corpora: list[str]
    layers: list[int]  # decoder layer index of each MoE layer
    num_experts: int
    top_k: int
    doc_corpus: np.ndarray  # (D,) index into corpora
    doc_id: np.ndarray  # (D,) the data stage's doc_ids
    doc_tokens: np.ndarray  # (D,) tokens of each document
    cells: Sparse  # code = layer_position * E + expert
    pairs: Sparse  # code = layer_position * E * E + lo * E + hi (lo < hi)

    @property
    def num_docs(self) -> int:
        return len(self.doc_id)

    @property
    def num_cells(self) -> int:
        return len(self.layers) * self.num_experts


class StatsCollector:
    """Accumulates ``PoolStats`` batch by batch from (doc_ids, chosen experts per MoE layer)."""

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int):
        self.layers, self.num_experts, self.top_k = list(layers), int(num_experts), int(top_k)
        self._index: dict[tuple[int, int], int] = {}
        self._corpus: list[int] = []
        self._doc_id: list[int] = []
        self._tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self._cells: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending = 0

    def _doc_indices(self, corpus: int, doc_ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(doc_ids), dtype=np.int64)
        for i, doc_id in enumerate(doc_ids.tolist()):
            key = (corpus, doc_id)
            if key not in self._index:
                self._index[key] = len(self._doc_id)
                self._corpus.append(corpus)
                self._doc_id.append(doc_id)
            out[i] = self._index[key]
        return out

    def add(self, corpus: int, doc_ids: np.ndarray, topk_per_layer: Sequence[np.ndarray]) -> None:
        """``doc_ids`` (T,) per token (-1: padding, not counted); ``topk_per_layer``: (T, k) per MoE layer."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if len(topk_per_layer) != len(self.layers):
            raise ValueError(f"expected routing for {len(self.layers)} MoE layers, got {len(topk_per_layer)}")
        valid = doc_ids >= 0
        if not valid.any():
            return
        batch_docs, local = np.unique(doc_ids[valid], return_inverse=True)
        local = local.reshape(-1)
        global_docs = self._doc_indices(corpus, batch_docs)
        self._tokens.append((global_docs, np.bincount(local, minlength=len(batch_docs))))
        E = self.num_experts
        for position, topk in enumerate(topk_per_layer):
            index = np.asarray(topk, dtype=np.int64).reshape(len(doc_ids), -1)[valid]
            keys, counts = np.unique((local[:, None] * E + index).ravel(), return_counts=True)
            self._cells.append((global_docs[keys // E], position * E + keys % E, counts))
            if index.shape[1] > 1:
                a, b = np.triu_indices(index.shape[1], 1)
                lo, hi = np.minimum(index[:, a], index[:, b]), np.maximum(index[:, a], index[:, b])
                keys, counts = np.unique(((local[:, None] * E + lo) * E + hi).ravel(), return_counts=True)
                self._pairs.append((global_docs[keys // (E * E)], position * E * E + keys % (E * E), counts))
        self._pending += len(doc_ids)
        if self._pending > (1 << 22):  # merge now and then: documents spanning batches repeat entries
            self._compact()

    def _compact(self) -> None:
        E, L = self.num_experts, len(self.layers)
        for chunks, width in ((self._cells, L * E), (self._pairs, L * E * E)):
            if len(chunks) > 1:
                merged = _sum_duplicates(*(np.concatenate(parts) for parts in zip(*chunks)), width)
                chunks[:] = [(merged.doc, merged.code, merged.count)]
        self._pending = 0

    def finish(self, corpora: Sequence[str]) -> PoolStats:
        self._compact()
        E, L = self.num_experts, len(self.layers)
        D = len(self._doc_id)
        doc_tokens = np.zeros(D, dtype=np.int64)
        for docs, counts in self._tokens:
            np.add.at(doc_tokens, docs, counts)

        def merged(chunks, width):
            if not chunks:
                return Sparse.empty()
            return _sum_duplicates(*(np.concatenate(parts) for parts in zip(*chunks)), width)

        return PoolStats(
            corpora=list(corpora),
            layers=self.layers,
            num_experts=E,
            top_k=self.top_k,
            doc_corpus=np.asarray(self._corpus, dtype=np.int64),
            doc_id=np.asarray(self._doc_id, dtype=np.int64),
            doc_tokens=doc_tokens,
            cells=merged(self._cells, L * E),
            pairs=merged(self._pairs, L * E * E),
        )


def _row_batches(rows: Iterable[Mapping[str, Any]], batch_tokens: int) -> Iterator[list[Mapping[str, Any]]]:
    """Consecutive rows, at most ``batch_tokens`` tokens a batch (at least one row)."""
    batch, tokens = [], 0
    for row in rows:
        n = len(row["input_ids"])
        if batch and tokens + n > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(row)
        tokens += n
    if batch:
        yield batch


def route_pool(
    model: Any,
    pools: Sequence[tuple[str, Iterable[Mapping[str, Any]]]],
    batch_tokens: int,
    attn_implementation: str,
    precision: str = "fp32",
    adapter: Any = None,
) -> PoolStats:
    """Route each pool's packed rows through ``model`` and collect per-document statistics.

    ``pools``: ``(corpus name, rows)`` with rows as the data stage writes them (``moeflow.tokenize``).
    """
    import torch

    from .collate import collate
    from .routing import adapter_for, capture
    from .stage import kill_point, progress

    adapter = adapter or adapter_for(model)
    collector = StatsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    model.eval()
    for corpus_index, (corpus, rows) in enumerate(pools):
        for batch_rows in progress(_row_batches(rows, batch_tokens), desc=f"route {corpus} (batches)"):
            batch = collate(batch_rows, attn_implementation)
            doc_ids = batch["doc_ids"].numpy()
            inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
            with torch.no_grad(), autocast, capture(model, adapter) as routing:
                model(**inputs, use_cache=False)
            collector.add(corpus_index, doc_ids.reshape(-1), [r.topk_index.cpu().numpy() for r in routing.layers])
            kill_point("coverage.batch")
    stats = collector.finish([name for name, _ in pools])
    log.info("routed %d documents (%d tokens) through %d MoE layers", stats.num_docs, stats.doc_tokens.sum(), len(stats.layers))
    return stats


# =========================================================================== packed bits

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


def masked_popcounts(words: np.ndarray, mask: np.ndarray, docs: np.ndarray | None = None, chunk: int = 8192) -> np.ndarray:
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


# =========================================================================== constraints


@dataclass
class Constraints:
    """Packed coverage bits: bit ``c % 64`` of ``words[doc, c // 64]`` says document ``doc`` meets constraint c.

    Constraints ``0 .. L*E-1`` are the (layer position, expert) cells; the next ``L*P`` are the top pairs
    of each layer (``pair_experts[l, p]``; ``(-1, -1)`` where a layer has fewer distinct pairs).
    """

    words: np.ndarray  # (D, ceil(C / 64)) uint64
    available: np.ndarray  # (C,) documents in the pool meeting each constraint
    num_layers: int
    num_experts: int
    pair_experts: np.ndarray  # (L, P, 2) int64

    @classmethod
    def from_dense(cls, meets: np.ndarray, num_layers: int, num_experts: int, pair_experts: np.ndarray) -> "Constraints":
        """From (D, C) booleans (tests and small pools)."""
        meets = np.asarray(meets, dtype=bool)
        return cls(pack_word_bits(meets), meets.sum(axis=0).astype(np.int64),
                   num_layers, num_experts, np.asarray(pair_experts, dtype=np.int64))

    @property
    def num_constraints(self) -> int:
        return len(self.available)

    @property
    def num_cells(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_docs(self) -> int:
        return self.words.shape[0]

    @property
    def valid(self) -> np.ndarray:
        """(C,) False for pair slots without a pair."""
        return np.r_[np.ones(self.num_cells, dtype=bool), self.pair_experts[..., 0].reshape(-1) >= 0]

    def column_counts(self, docs: np.ndarray, chunk: int = 1024) -> np.ndarray:
        """(C,) how many of the documents ``docs`` meet each constraint."""
        counts = np.zeros(self.words.shape[1] * WORD, dtype=np.int64)
        for start in range(0, len(docs), chunk):
            sub = self.words[docs[start : start + chunk]]  # (n, W)
            counts += ((sub[:, :, None] >> _SHIFTS) & np.uint64(1)).sum(axis=0, dtype=np.int64).reshape(-1)
        return counts[: self.num_constraints]

    def meets(self, doc: int) -> np.ndarray:
        """(C,) the constraints document ``doc`` meets."""
        return unpack_word_bits(self.words[doc], self.num_constraints)


def top_pairs(stats: PoolStats, pairs_per_layer: int) -> np.ndarray:
    """(L, P, 2) the most frequent expert pairs of each layer by tokens (ties: lower pair first)."""
    L, E = len(stats.layers), stats.num_experts
    out = np.full((L, pairs_per_layer, 2), -1, dtype=np.int64)
    if pairs_per_layer == 0 or stats.pairs.code.size == 0:
        return out
    totals = np.bincount(stats.pairs.code, weights=stats.pairs.count, minlength=L * E * E).reshape(L, E * E)
    for position in range(L):
        order = np.lexsort((np.arange(E * E), -totals[position]))[:pairs_per_layer]
        order = order[totals[position, order] > 0]
        out[position, : len(order)] = np.stack([order // E, order % E], axis=1)
    return out


def build_constraints(stats: PoolStats, min_tokens: int, pairs_per_layer: int) -> Constraints:
    L, E, D = len(stats.layers), stats.num_experts, stats.num_docs
    pair_experts = top_pairs(stats, pairs_per_layer)
    num_constraints = L * E + L * pairs_per_layer
    keep = stats.cells.count >= min_tokens
    docs, constraint = [stats.cells.doc[keep]], [stats.cells.code[keep]]
    if pairs_per_layer:
        # pair code -> constraint index (or -1 if the pair is not among its layer's top pairs)
        slot = np.full(L * E * E, -1, dtype=np.int64)
        for position in range(L):
            for p, (a, b) in enumerate(pair_experts[position]):
                if a >= 0:
                    slot[position * E * E + a * E + b] = L * E + position * pairs_per_layer + p
        wanted = slot[stats.pairs.code]
        keep = (wanted >= 0) & (stats.pairs.count >= min_tokens)
        docs.append(stats.pairs.doc[keep])
        constraint.append(wanted[keep])
    doc, constraint = np.concatenate(docs), np.concatenate(constraint)  # unique (doc, constraint) entries
    num_words = (num_constraints + WORD - 1) // WORD
    words = np.zeros((D, num_words), dtype=np.uint64)
    np.bitwise_or.at(words.reshape(-1), doc * num_words + constraint // WORD, np.left_shift(np.uint64(1), (constraint % WORD).astype(np.uint64)))
    available = np.bincount(constraint, minlength=num_constraints).astype(np.int64)
    return Constraints(words, available, L, E, pair_experts)


# =========================================================================== selection


@dataclass
class Selection:
    selected: np.ndarray  # doc indices: first the greedy picks (in pick order), then the fill
    greedy_count: int
    demand: np.ndarray  # (C,) documents required per constraint (capped at what the pool has)
    shortfall: np.ndarray  # (C,) documents still missing after the greedy (0 where met)
    tokens: int

    def selected_mask(self, num_docs: int) -> np.ndarray:
        mask = np.zeros(num_docs, dtype=bool)
        mask[self.selected] = True
        return mask


def seeded_rank(num_docs: int, seed: int) -> np.ndarray:
    """A seeded random rank per document (the tie-breaker, and the order of random fills)."""
    rank = np.empty(num_docs, dtype=np.int64)
    rank[np.random.default_rng(seed).permutation(num_docs)] = np.arange(num_docs)
    return rank


def greedy_multicover(words: np.ndarray, demand: np.ndarray, cost: np.ndarray, budget: int, rank: np.ndarray,
                      refresh: int = 256, hot_size: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Pick documents until every constraint has ``demand`` of them, or no pick within budget helps.

    Each step takes the document with the most still-needed constraints per token (ties: lowest rank).
    Lazy greedy: once constraints are satisfied every score is only an upper bound (scores can only
    fall), so only the highest are recounted, ``refresh`` at a time, vectorised over the packed bits,
    until the best is exact. The search runs in a "hot" set of the ``hot_size`` highest scores while its
    best beats every score outside it, and the set is rebuilt otherwise. Documents that drop to zero or
    out of the budget are compacted away. The picks equal those of the plain greedy. Returns (picked
    doc indices in order, remaining demand).
    """
    num_constraints = len(demand)
    demand = np.asarray(demand, dtype=np.int64).copy()
    needed = pack_word_bits(demand > 0)
    remaining = int(budget)
    cost_all = np.asarray(cost, dtype=np.int64)
    gains = masked_popcounts(words, needed)
    live = np.flatnonzero((gains > 0) & (cost_all <= remaining))  # documents still in play
    cost, rank = cost_all[live], np.asarray(rank)[live]
    inv_cost = 1.0 / np.maximum(cost, 1)
    score = gains[live] * inv_cost
    fresh = np.ones(len(live), dtype=bool)  # score is exact, not just an upper bound

    def recount(positions: np.ndarray) -> None:
        g = masked_popcounts(words, needed, live[positions])
        score[positions] = np.where((g > 0) & (cost[positions] <= remaining), g * inv_cost[positions], -1.0)
        fresh[positions] = True

    def hot_set(everything: bool = False) -> tuple[np.ndarray, float]:
        """The positions of the highest scores, and the highest score outside them."""
        if everything or len(live) <= hot_size:
            return np.arange(len(live)), -np.inf
        hot = np.argpartition(-score, hot_size - 1)[:hot_size]
        rest = score.copy()
        rest[hot] = -np.inf
        return hot, float(rest.max())

    picked: list[int] = []
    hot, bound = hot_set()
    rebuilt = True
    while len(hot):
        k = int(hot[np.argmax(score[hot])])
        best = score[k]
        if best <= bound:  # something outside may be better (or tie with a lower rank)
            hot, bound = hot_set(everything=rebuilt)  # ties across a fresh partition: search everything
            rebuilt = True
            continue
        rebuilt = False
        if best <= 0:
            break
        if not fresh[k]:
            size = min(refresh, len(hot))
            top = hot[np.argpartition(-score[hot], size - 1)[:size]] if size < len(hot) else hot
            recount(np.r_[k, top])  # k itself: with many ties the partition may leave it out
            continue
        ties = hot[score[hot] == best]
        if ties.size > 1:
            if not fresh[ties].all():
                recount(ties)
                continue
            k = int(ties[np.argmin(rank[ties])])
        picked.append(int(live[k]))
        remaining -= int(cost[k])
        covered = np.flatnonzero(unpack_word_bits(words[live[k]] & needed, num_constraints))
        demand[covered] -= 1
        done = covered[demand[covered] == 0]
        if done.size:
            needed &= ~pack_word_bits(np.isin(np.arange(num_constraints), done))
            fresh[:] = False
        cost[k] = np.iinfo(np.int64).max  # never again in play, even if a recount reaches it
        score[cost > remaining] = -1.0
        out = score <= 0
        if 4 * int(out.sum()) > len(live):
            keep = ~out
            live, cost, rank, inv_cost, score, fresh = live[keep], cost[keep], rank[keep], inv_cost[keep], score[keep], fresh[keep]
            hot, bound = hot_set()
            rebuilt = True
    return np.asarray(picked, dtype=np.int64), demand


def fill_to_distribution(chosen: np.ndarray, cost: np.ndarray, group: np.ndarray, budget: int, rank: np.ndarray) -> np.ndarray:
    """Add documents in ``rank`` order so each group (pool corpus) approaches its pool share of the
    token budget; returns the added doc indices."""
    cost = np.asarray(cost, dtype=np.int64)
    total = int(cost.sum())
    taken = np.zeros(len(cost), dtype=bool)
    taken[chosen] = True
    remaining = int(budget) - int(cost[chosen].sum())
    added: list[int] = []
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        quota = int(budget * cost[members].sum() // max(total, 1)) - int(cost[members[taken[members]]].sum())
        candidates = members[~taken[members]]
        candidates = candidates[np.argsort(rank[candidates], kind="stable")]
        smallest = int(cost[candidates].min()) if candidates.size else 0
        for j in candidates.tolist():
            limit = min(quota, remaining)
            if limit < smallest:
                break
            if cost[j] <= limit:
                added.append(j)
                quota -= int(cost[j])
                remaining -= int(cost[j])
    return np.asarray(sorted(added, key=lambda j: rank[j]), dtype=np.int64)


def select_documents(constraints: Constraints, cost: np.ndarray, group: np.ndarray, min_docs: int, budget: int, seed: int) -> Selection:
    """Greedy multi-cover (demand ``min_docs`` per constraint, capped at what the pool has), then fill."""
    rank = seeded_rank(constraints.num_docs, seed)
    demand = np.minimum(constraints.available, min_docs) * constraints.valid
    picked, shortfall = greedy_multicover(constraints.words, demand, cost, budget, rank)
    added = fill_to_distribution(picked, cost, group, budget, rank)
    selected = np.r_[picked, added].astype(np.int64)
    return Selection(selected, len(picked), demand, shortfall, int(np.asarray(cost)[selected].sum()))


# =========================================================================== reporting


def _constraint_name(constraints: Constraints, layers: Sequence[int], c: int) -> tuple[int, str]:
    L, E = constraints.num_layers, constraints.num_experts
    if c < L * E:
        return layers[c // E], f"expert {c % E}"
    position, p = divmod(c - L * E, constraints.pair_experts.shape[1])
    a, b = constraints.pair_experts[position, p]
    return layers[position], f"pair {a}+{b}"


def unmet_constraints(constraints: Constraints, layers: Sequence[int], selection: Selection, min_docs: int) -> list[dict[str, Any]]:
    """Every valid constraint the selection leaves below ``min_docs`` documents, with the reason."""
    got = constraints.column_counts(np.sort(selection.selected))
    out = []
    for c in np.flatnonzero((got < min_docs) & constraints.valid).tolist():
        layer, what = _constraint_name(constraints, layers, c)
        reason = "pool" if constraints.available[c] < min_docs else "token_budget"
        out.append({"layer": layer, "constraint": what, "docs": int(got[c]), "pool_docs": int(constraints.available[c]), "reason": reason})
    return out


def infeasible_message(unmet: Sequence[Mapping[str, Any]], min_docs: int, min_tokens: int) -> str:
    by_layer: dict[int, list[str]] = {}
    for u in unmet:
        by_layer.setdefault(u["layer"], []).append(f"{u['constraint']} ({u['pool_docs']} in pool, {u['docs']} selected)")
    lines = [f"  layer {layer}: " + ", ".join(items) for layer, items in sorted(by_layer.items())]
    reasons = {u["reason"] for u in unmet}
    remedy = [f"set '{ALLOW_UNMET_KEY}: true' to record them as unmet instead"]
    if "token_budget" in reasons:
        remedy.insert(0, "raise 'coverage.token_budget'")
    if "pool" in reasons:
        remedy.insert(0, "add held-out documents to 'coverage.pool_corpora' or lower 'coverage.min_docs_per_expert'/'coverage.min_tokens'")
    return (
        f"expert coverage cannot be met: {len(unmet)} constraint(s) have fewer than {min_docs} documents with "
        f">= {min_tokens} routed tokens:\n" + "\n".join(lines) + "\nTo proceed: " + "; or ".join(remedy) + "."
    )


def random_comparison(constraints: Constraints, cost: np.ndarray, tokens: int, min_docs: int, draws: int, seed: int) -> dict[str, Any]:
    """Random subsets with (at most) the same number of tokens: cells and pairs left below ``min_docs``."""
    cost = np.asarray(cost, dtype=np.int64)
    valid = constraints.valid
    cells = np.arange(constraints.num_constraints) < constraints.num_cells
    rng = np.random.default_rng([seed, 1])
    per_draw = []
    first_counts = None
    for _ in range(draws):
        order = rng.permutation(len(cost))
        subset = order[np.cumsum(cost[order]) <= tokens]
        got = constraints.column_counts(np.sort(subset))
        if first_counts is None:
            first_counts = got
        below = (got < min_docs) & valid
        per_draw.append({"docs": int(len(subset)), "tokens": int(cost[subset].sum()),
                         "cells_below": int(below[cells].sum()), "pairs_below": int(below[~cells].sum())})

    def summary(key: str) -> dict[str, Any]:
        values = np.array([d[key] for d in per_draw], dtype=np.float64)
        return {"mean": float(values.mean()), "min": int(values.min()), "max": int(values.max())}

    return {
        "draws": draws,
        "size": "same token count as the validation set (random documents until the next would exceed it)",
        "cells_below": summary("cells_below"),
        "pairs_below": summary("pairs_below"),
        "per_draw": per_draw,
        "first_draw_cell_docs": first_counts[: constraints.num_cells].reshape(constraints.num_layers, -1).tolist(),
    }


def cell_table(stats: PoolStats, docs_mask: np.ndarray, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, E) documents with >= min_tokens tokens, and tokens, per cell, over the masked documents."""
    L, E = len(stats.layers), stats.num_experts
    keep = docs_mask[stats.cells.doc]
    tokens = np.bincount(stats.cells.code[keep], weights=stats.cells.count[keep], minlength=L * E)
    meets = keep & (stats.cells.count >= min_tokens)
    docs = np.bincount(stats.cells.code[meets], minlength=L * E)
    return docs.reshape(L, E).astype(np.int64), tokens.reshape(L, E).astype(np.int64)


def _load_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over layers of the total-variation distance between two (L, E) token distributions."""
    pa = a / np.maximum(a.sum(axis=1, keepdims=True), 1)
    pb = b / np.maximum(b.sum(axis=1, keepdims=True), 1)
    return float(0.5 * np.abs(pa - pb).sum(axis=1).mean())


def coverage_report(stats: PoolStats, constraints: Constraints, selection: Selection, settings: Mapping[str, Any],
                    seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``coverage.json``'s content, and the (L, E) document counts per cell of the validation set and of
    the first random subset (for the heatmap)."""
    min_docs, min_tokens = int(settings["min_docs_per_expert"]), int(settings["min_tokens"])
    D = stats.num_docs
    chosen = selection.selected_mask(D)
    docs, tokens = cell_table(stats, chosen, min_tokens)
    pool_docs, pool_tokens = cell_table(stats, np.ones(D, dtype=bool), min_tokens)
    got = constraints.column_counts(np.sort(selection.selected))
    P = constraints.pair_experts.shape[1]
    layers = []
    for position, layer in enumerate(stats.layers):
        pairs = []
        for p in range(P):
            a, b = constraints.pair_experts[position, p].tolist()
            if a >= 0:
                c = constraints.num_cells + position * P + p
                pairs.append({"experts": [a, b], "docs": int(got[c]), "pool_docs": int(constraints.available[c])})
        layers.append({
            "layer": layer,
            "docs": docs[position].tolist(),
            "tokens": tokens[position].tolist(),
            "pool_docs": pool_docs[position].tolist(),
            "pool_tokens": pool_tokens[position].tolist(),
            "top_pairs": pairs,
        })
    comparison = random_comparison(constraints, stats.doc_tokens, selection.tokens, min_docs, int(settings.get("random_draws", 10)), seed)
    random_first = np.asarray(comparison.pop("first_draw_cell_docs"))
    valid = constraints.valid
    below = (got < min_docs) & valid
    cells = np.arange(constraints.num_constraints) < constraints.num_cells
    unmet = unmet_constraints(constraints, stats.layers, selection, min_docs)

    def by_corpus(mask: np.ndarray) -> dict[str, Any]:
        return {name: {"docs": int((mask & (stats.doc_corpus == i)).sum()),
                       "tokens": int(stats.doc_tokens[mask & (stats.doc_corpus == i)].sum())}
                for i, name in enumerate(stats.corpora)}

    return {
        "settings": dict(settings),
        "seed": seed,
        "model": {"moe_layers": stats.layers, "num_experts": stats.num_experts, "top_k": stats.top_k},
        "pool": {"docs": D, "tokens": int(stats.doc_tokens.sum()), "by_corpus": by_corpus(np.ones(D, dtype=bool))},
        "valset": {
            "docs": int(len(selection.selected)),
            "tokens": selection.tokens,
            "token_budget": int(settings["token_budget"]),
            "greedy_docs": selection.greedy_count,
            "fill_docs": int(len(selection.selected) - selection.greedy_count),
            "by_corpus": by_corpus(chosen),
            "cells_below": int(below[cells].sum()),
            "pairs_below": int(below[~cells].sum()),
            "expert_load_distance_to_pool": _load_distance(tokens, pool_tokens),
        },
        "layers": layers,
        "unmet": unmet,
        "random_comparison": comparison,
    }, {"valset": docs, "random": random_first}


def plot_heatmap(path: str | os.PathLike, layers: Sequence[int], valset_docs: np.ndarray, random_docs: np.ndarray, min_docs: int) -> None:
    """Layers x experts: documents meeting each cell, the validation set beside a random subset of the same
    size; cells below the threshold are marked. Deterministic bytes (no timestamps, no software tag)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import atomic_file

    vmax = max(2 * min_docs, 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.35 * len(layers)), sharey=True, constrained_layout=True)
    for ax, counts, title in ((axes[0], valset_docs, "coverage validation set"), (axes[1], random_docs, "random subset, same tokens")):
        image = ax.imshow(np.minimum(counts, vmax), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        below_l, below_e = np.nonzero(counts < min_docs)
        ax.scatter(below_e, below_l, marker="x", color="red", s=12, linewidths=0.8)
        ax.set_title(f"{title}: {len(below_l)} cells below {min_docs} docs", fontsize=10)
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    axes[0].set_ylabel("MoE layer (decoder index)")
    fig.colorbar(image, ax=axes, label=f"documents (capped at {vmax})")
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


# =========================================================================== the validation set on disk


def write_valset(pool_dirs: Sequence[str | os.PathLike], selected: Mapping[int, set[int]], out_dir: str | os.PathLike,
                 extra_manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Write the selected held-out documents (``selected[corpus position] = doc_ids``) in the data stage's
    format: ``out_dir/manifest.json`` and ``out_dir/heldout/shard-*.arrow`` (open with ``open_valset``)."""
    from .tokenize import MANIFEST, open_split, pack_documents, read_documents, write_split

    first = read_json(Path(pool_dirs[0]) / MANIFEST)

    def documents() -> Iterator[tuple[int, list[int], None]]:
        for position, corpus_dir in enumerate(pool_dirs):
            wanted = selected.get(position, set())
            if wanted:
                for doc_id, ids in read_documents(open_split(corpus_dir, VALSET_SPLIT)):
                    if doc_id in wanted:
                        yield doc_id, ids, None

    rows = pack_documents(documents(), first["seq_len"], first.get("pad_to_multiple_of", 64), first.get("pad_id", 0))
    with atomic_dir(out_dir) as tmp:
        shards = write_split(tmp / VALSET_SPLIT, rows, first.get("settings", {}).get("data", {}).get("shard_max_bytes", 32 << 20))
        manifest = {
            "kind": "coverage validation set",
            "split": VALSET_SPLIT,
            "seq_len": first["seq_len"],
            "pad_to_multiple_of": first.get("pad_to_multiple_of", 64),
            "pad_id": first.get("pad_id", 0),
            "shards": shards,
            **extra_manifest,
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest


def open_valset(valset_dir: str | os.PathLike):
    """The validation set as a ``datasets.Dataset`` (rows in the data stage's format)."""
    from .tokenize import open_split

    return open_split(valset_dir, VALSET_SPLIT)


@dataclass
class StageOutputs:
    valset: str | os.PathLike
    json: str | os.PathLike
    heatmap: str | os.PathLike


def build_valset(model: Any, pool_dirs: Sequence[str | os.PathLike], settings: Mapping[str, Any], outputs: StageOutputs,
                 attn_implementation: str, seed: int, precision: str = "fp32", provenance: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The coverage stage: route the pools, select, check, write the valset, coverage.json and the heatmap."""
    from .stage import kill_point
    from .tokenize import iter_rows, open_split

    corpora = list(settings["pool_corpora"])
    if len(corpora) != len(pool_dirs):
        raise ValueError(f"{len(pool_dirs)} pool folders for {len(corpora)} corpora in 'coverage.pool_corpora'")
    from .routing import UnsupportedModel, adapter_for

    try:
        adapter = adapter_for(model)
    except UnsupportedModel as exc:
        raise UnsupportedModel(
            f"the coverage stage routes the held-out pool through the model's experts, and this model has none it can "
            f"read: {str(exc).rstrip('.')}. A dense run uses another run's validation set: set 'coverage.valset_of_run' to an MoE run"
        ) from None
    pools = [(name, iter_rows(open_split(path, VALSET_SPLIT))) for name, path in zip(corpora, pool_dirs)]
    stats = route_pool(model, pools, int(settings["batch_tokens"]), attn_implementation, precision, adapter)
    min_docs, min_tokens = int(settings["min_docs_per_expert"]), int(settings["min_tokens"])
    if stats.num_docs == 0:
        raise CoverageInfeasible(f"the held-out pool of {', '.join(corpora)} has no documents: raise 'data.split.heldout'")
    constraints = build_constraints(stats, min_tokens, int(settings["pairs_per_layer"]))
    selection = select_documents(constraints, stats.doc_tokens, stats.doc_corpus, min_docs, int(settings["token_budget"]), seed)
    report, heat = coverage_report(stats, constraints, selection, settings, seed)
    if report["unmet"] and not settings.get("allow_unmet", False):
        message = infeasible_message(report["unmet"], min_docs, min_tokens)
        if stats.num_docs < min_docs:
            message = (f"the held-out pool of {', '.join(corpora)} has {stats.num_docs} document(s), fewer than "
                       f"'coverage.min_docs_per_expert' ({min_docs}), so no expert can be covered. {message}")
        raise CoverageInfeasible(message)
    kill_point("coverage.before_write")
    selected: dict[int, set[int]] = {}
    for j in selection.selected.tolist():
        selected.setdefault(int(stats.doc_corpus[j]), set()).add(int(stats.doc_id[j]))
    report["provenance"] = dict(provenance or {})
    write_valset(pool_dirs, selected, outputs.valset, {"corpora": corpora, "docs": report["valset"]["docs"],
                                                       "tokens": report["valset"]["tokens"], "provenance": report["provenance"]})
    kill_point("coverage.after_valset")  # one output written, two to go: what a rerun must not mistake for done
    plot_heatmap(outputs.heatmap, stats.layers, heat["valset"], heat["random"], min_docs)
    write_json(outputs.json, report)
    return report
