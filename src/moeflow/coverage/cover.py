"""Choosing the coverage validation set from routing statistics: constraints, greedy multi-cover, report.

Choosing the expert-coverage validation set from a pool's routing statistics (``moeflow.evaluation.routing_stats``):
constraints, greedy multi-cover, and the report with its random comparison.

1. **Constraints** (``build_constraints``): one per (layer, expert), plus the ``pairs_per_layer`` most
   frequent pairs of each layer. A document *meets* a constraint if at least ``min_tokens`` of its
   tokens were routed there. Kept as packed bits (``moeflow.coverage.bitsets``): bit ``c % 64`` of
   ``words[doc, c // 64]``.
2. **Selection** (``select_documents``): greedy multi-cover within the token budget; each constraint
   needs ``min_docs_per_expert`` documents. The greedy picks the document with the most still-needed
   constraints per token: a lazy greedy over the packed bits (scores only fall as constraints are met,
   so only the highest stale scores are recounted, vectorised in blocks), with no loop over documents
   x experts. Ties go to a seeded random
   rank. Then the budget is filled with random documents so that each pool corpus keeps its share of
   tokens. Constraints the pool cannot meet fail the stage (``CoverageInfeasible``) unless
   ``coverage.allow_unmet`` records them.
3. **Comparison** (``random_comparison``): random subsets of the same token count; how many cells and
   pairs they leave below the threshold.

The stage that routes the pool and writes the validation set is ``moeflow.coverage.build``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeflow.coverage.bitsets import WORD, column_bit_counts, masked_popcounts, pack_word_bits, unpack_word_bits
from moeflow.evaluation.routing_stats import PoolStats, cell_table

ALLOW_UNMET_KEY = "coverage.allow_unmet"


class CoverageInfeasible(RuntimeError):
    """Constraints no selection can meet (from the pool, or within the token budget)."""


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
    def from_dense(cls, meets: np.ndarray, num_layers: int, num_experts: int, pair_experts: np.ndarray) -> Constraints:
        """From (D, C) booleans (tests and small pools)."""
        meets = np.asarray(meets, dtype=bool)
        return cls(
            pack_word_bits(meets),
            meets.sum(axis=0).astype(np.int64),
            num_layers,
            num_experts,
            np.asarray(pair_experts, dtype=np.int64),
        )

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
        return column_bit_counts(self.words, docs, self.num_constraints, chunk)

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
    np.bitwise_or.at(
        words.reshape(-1),
        doc * num_words + constraint // WORD,
        np.left_shift(np.uint64(1), (constraint % WORD).astype(np.uint64)),
    )
    available = np.bincount(constraint, minlength=num_constraints).astype(np.int64)
    return Constraints(words, available, L, E, pair_experts)


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


def greedy_multicover(
    words: np.ndarray,
    demand: np.ndarray,
    cost: np.ndarray,
    budget: int,
    rank: np.ndarray,
    refresh: int = 256,
    hot_size: int = 8192,
) -> tuple[np.ndarray, np.ndarray]:
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
            live, cost, rank, inv_cost, score, fresh = (
                live[keep],
                cost[keep],
                rank[keep],
                inv_cost[keep],
                score[keep],
                fresh[keep],
            )
            hot, bound = hot_set()
            rebuilt = True
    return np.asarray(picked, dtype=np.int64), demand


def fill_to_distribution(
    chosen: np.ndarray, cost: np.ndarray, group: np.ndarray, budget: int, rank: np.ndarray
) -> np.ndarray:
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


def select_documents(
    constraints: Constraints, cost: np.ndarray, group: np.ndarray, min_docs: int, budget: int, seed: int
) -> Selection:
    """Greedy multi-cover (demand ``min_docs`` per constraint, capped at what the pool has), then fill."""
    rank = seeded_rank(constraints.num_docs, seed)
    demand = np.minimum(constraints.available, min_docs) * constraints.valid
    picked, shortfall = greedy_multicover(constraints.words, demand, cost, budget, rank)
    added = fill_to_distribution(picked, cost, group, budget, rank)
    selected = np.r_[picked, added].astype(np.int64)
    return Selection(selected, len(picked), demand, shortfall, int(np.asarray(cost)[selected].sum()))


def _constraint_name(constraints: Constraints, layers: Sequence[int], c: int) -> tuple[int, str]:
    L, E = constraints.num_layers, constraints.num_experts
    if c < L * E:
        return layers[c // E], f"expert {c % E}"
    position, p = divmod(c - L * E, constraints.pair_experts.shape[1])
    a, b = constraints.pair_experts[position, p]
    return layers[position], f"pair {a}+{b}"


def unmet_constraints(
    constraints: Constraints, layers: Sequence[int], selection: Selection, min_docs: int
) -> list[dict[str, Any]]:
    """Every valid constraint the selection leaves below ``min_docs`` documents, with the reason."""
    got = constraints.column_counts(np.sort(selection.selected))
    out = []
    for c in np.flatnonzero((got < min_docs) & constraints.valid).tolist():
        layer, what = _constraint_name(constraints, layers, c)
        reason = "pool" if constraints.available[c] < min_docs else "token_budget"
        out.append(
            {
                "layer": layer,
                "constraint": what,
                "docs": int(got[c]),
                "pool_docs": int(constraints.available[c]),
                "reason": reason,
            }
        )
    return out


def infeasible_message(unmet: Sequence[Mapping[str, Any]], min_docs: int, min_tokens: int) -> str:
    by_layer: dict[int, list[str]] = {}
    for u in unmet:
        by_layer.setdefault(u["layer"], []).append(
            f"{u['constraint']} ({u['pool_docs']} in pool, {u['docs']} selected)"
        )
    lines = [f"  layer {layer}: " + ", ".join(items) for layer, items in sorted(by_layer.items())]
    reasons = {u["reason"] for u in unmet}
    remedy = [f"set '{ALLOW_UNMET_KEY}: true' to record them as unmet instead"]
    if "token_budget" in reasons:
        remedy.insert(0, "raise 'coverage.token_budget'")
    if "pool" in reasons:
        remedy.insert(
            0,
            "add held-out documents to 'coverage.pool_corpora' "
            "or lower 'coverage.min_docs_per_expert'/'coverage.min_tokens'",
        )
    return (
        f"expert coverage cannot be met: {len(unmet)} constraint(s) have fewer than {min_docs} documents with "
        f">= {min_tokens} routed tokens:\n" + "\n".join(lines) + "\nTo proceed: " + "; or ".join(remedy) + "."
    )


def random_comparison(
    constraints: Constraints, cost: np.ndarray, tokens: int, min_docs: int, draws: int, seed: int
) -> dict[str, Any]:
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
        per_draw.append(
            {
                "docs": int(len(subset)),
                "tokens": int(cost[subset].sum()),
                "cells_below": int(below[cells].sum()),
                "pairs_below": int(below[~cells].sum()),
            }
        )

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


def _load_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over layers of the total-variation distance between two (L, E) token distributions."""
    pa = a / np.maximum(a.sum(axis=1, keepdims=True), 1)
    pb = b / np.maximum(b.sum(axis=1, keepdims=True), 1)
    return float(0.5 * np.abs(pa - pb).sum(axis=1).mean())


def coverage_report(
    stats: PoolStats, constraints: Constraints, selection: Selection, settings: Mapping[str, Any], seed: int
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
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
        layers.append(
            {
                "layer": layer,
                "docs": docs[position].tolist(),
                "tokens": tokens[position].tolist(),
                "pool_docs": pool_docs[position].tolist(),
                "pool_tokens": pool_tokens[position].tolist(),
                "top_pairs": pairs,
            }
        )
    comparison = random_comparison(
        constraints, stats.doc_tokens, selection.tokens, min_docs, int(settings["random_draws"]), seed
    )
    random_first = np.asarray(comparison.pop("first_draw_cell_docs"))
    valid = constraints.valid
    below = (got < min_docs) & valid
    cells = np.arange(constraints.num_constraints) < constraints.num_cells
    unmet = unmet_constraints(constraints, stats.layers, selection, min_docs)

    def by_corpus(mask: np.ndarray) -> dict[str, Any]:
        return {
            name: {
                "docs": int((mask & (stats.doc_corpus == i)).sum()),
                "tokens": int(stats.doc_tokens[mask & (stats.doc_corpus == i)].sum()),
            }
            for i, name in enumerate(stats.corpora)
        }

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
