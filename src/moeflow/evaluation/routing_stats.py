"""Per-document routing statistics of a document pool (what the coverage validation set is chosen from).

The held-out pool goes through the base model in batches of about ``batch_tokens`` tokens (no grad,
packed documents masked from each other by ``moeflow.data.collate``); ``moeflow.model.routing.capture`` gives each
token's chosen experts and the row column ``doc_ids`` attributes it to its document. Kept per document,
sparse: tokens routed to each (layer, expert) and tokens on which each pair of experts was chosen
together (``PoolStats``). Memory grows with the number of distinct (document, layer, expert) and
(document, layer, pair) entries, never with tokens x experts.

With several ranks (``route_pool``'s ``ranks``) each routes its share of each pool's batches, every rank as many
forwards (a sharded model's forward is a collective), and the main rank merges the parts into the statistics
one process would have collected (``merge_parts``: the same documents in the same order, the same counts).

``layer_health`` is the balance of one layer's expert load, as the training guards, the Trainer's log and
the evaluation report it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeflow.data.collate import collate, model_inputs
from moeflow.model.chunked_loss import decoder_forward
from moeflow.model.routing import adapter_for, capture
from moeflow.parallel.process_group import Ranks, gather_to_main
from moeflow.runtime.host_copies import model_device
from moeflow.runtime.stage import kill_point, progress

log = logging.getLogger(__name__)


@dataclass
class Sparse:
    """Per-document counts: ``count[i]`` tokens of document ``doc[i]`` on constraint code ``code[i]``."""

    doc: np.ndarray
    code: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls) -> Sparse:
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
        self._first_batch: list[int] = []  # the pool batch each document first appeared in (merge_parts' order)
        self._tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self._cells: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending = 0

    def _doc_indices(self, corpus: int, doc_ids: np.ndarray, batch: int) -> np.ndarray:
        out = np.empty(len(doc_ids), dtype=np.int64)
        for i, doc_id in enumerate(doc_ids.tolist()):
            key = (corpus, doc_id)
            if key not in self._index:
                self._index[key] = len(self._doc_id)
                self._corpus.append(corpus)
                self._doc_id.append(doc_id)
                self._first_batch.append(batch)
            out[i] = self._index[key]
        return out

    def add(self, corpus: int, doc_ids: np.ndarray, topk_per_layer: Sequence[np.ndarray], batch: int = 0) -> None:
        """``doc_ids`` (T,) per token (-1: padding, not counted); ``topk_per_layer``: (T, k) per MoE layer;
        ``batch``: the batch's place in its pool (what orders the documents when ranks' parts are merged)."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if len(topk_per_layer) != len(self.layers):
            raise ValueError(f"expected routing for {len(self.layers)} MoE layers, got {len(topk_per_layer)}")
        valid = doc_ids >= 0
        if not valid.any():
            return
        batch_docs, local = np.unique(doc_ids[valid], return_inverse=True)
        local = local.reshape(-1)
        global_docs = self._doc_indices(corpus, batch_docs, batch)
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

    def first_batches(self) -> np.ndarray:
        """(D,) the pool batch each document of :meth:`finish` first appeared in."""
        return np.asarray(self._first_batch, dtype=np.int64)


def merge_parts(parts: Sequence[tuple[PoolStats, np.ndarray]]) -> PoolStats:
    """The statistics of a whole pool from ranks' parts (each its :class:`PoolStats` and its documents' first
    batches), as one process collects them: documents in the order they first appear (corpus, then batch, then
    doc id, as ``StatsCollector.add`` indexes a batch's sorted ids), a document that spans batches of several
    ranks counted once with its tokens and routings added up."""
    first, rest = parts[0][0], [p for p, _ in parts]
    corpus = np.concatenate([p.doc_corpus for p in rest])
    doc_id = np.concatenate([p.doc_id for p in rest])
    first_batch = np.concatenate([f for _, f in parts])
    keys = np.stack([corpus, doc_id], axis=1)
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    earliest = np.full(len(unique), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(earliest, inverse, first_batch)
    order = np.lexsort((unique[:, 1], earliest, unique[:, 0]))
    position = np.empty(len(unique), dtype=np.int64)
    position[order] = np.arange(len(unique))
    to_global = position[inverse]  # each part's document, in the parts' concatenated order -> its merged index
    offsets = np.cumsum([0] + [p.num_docs for p in rest])
    doc_tokens = np.zeros(len(unique), dtype=np.int64)
    np.add.at(doc_tokens, to_global, np.concatenate([p.doc_tokens for p in rest]))
    E, L = first.num_experts, len(first.layers)

    def merged(field: str, width: int) -> Sparse:
        docs = [to_global[offsets[i] + getattr(p, field).doc] for i, p in enumerate(rest)]
        codes = [getattr(p, field).code for p in rest]
        counts = [getattr(p, field).count for p in rest]
        return _sum_duplicates(np.concatenate(docs), np.concatenate(codes), np.concatenate(counts), width)

    return PoolStats(
        corpora=list(first.corpora),
        layers=list(first.layers),
        num_experts=E,
        top_k=first.top_k,
        doc_corpus=unique[order, 0].astype(np.int64),
        doc_id=unique[order, 1].astype(np.int64),
        doc_tokens=doc_tokens,
        cells=merged("cells", L * E),
        pairs=merged("pairs", L * E * E),
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


def rank_batches(
    rows: Iterable[Mapping[str, Any]], batch_tokens: int, rank: int, world: int
) -> Iterator[tuple[int, list[Mapping[str, Any]]]]:
    """``(place in the pool, rows)`` of this rank's batches of one pool: batches rank, rank + world, ...; then, so
    that every rank runs as many forwards, fillers ``(-1, the pool's first batch)``, routed but not counted."""
    first, count = None, 0
    for place, batch in enumerate(_row_batches(rows, batch_tokens)):
        first, count = first or batch, place + 1
        if place % world == rank:
            yield place, batch
    for _ in range(-(-count // world) - len(range(rank, count, world))):
        yield -1, first


def route_pool(
    model: Any,
    pools: Sequence[tuple[str, Iterable[Mapping[str, Any]]]],
    batch_tokens: int,
    attn_implementation: str,
    precision: str = "fp32",
    adapter: Any = None,
    observers: Sequence[Any] = (),
    ranks: Ranks | None = None,
) -> PoolStats | None:
    """Route each pool's packed rows through ``model`` and collect per-document statistics.

    ``pools``: ``(corpus name, rows)`` with rows as the data stage writes them (``moeflow.data.shards``).
    ``ranks`` (several ranks holding ``model`` in a layout): each routes its
    share of the batches and the main rank gets the whole pool's statistics, the other ranks None.
    ``observers``: objects whose ``add(routing_layers, keep, batch=(pool index, place in the pool))`` also sees
    each batch's captured routing and its real-token mask (e.g. ``moeflow.train.esft.TotalsCollector``), so other
    statistics share this one pass; with several ranks they see this rank's batches only (fillers never), and
    their caller merges the ranks' parts.
    """
    adapter = adapter or adapter_for(model)
    collector = StatsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)
    device = model_device(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    model.eval()
    for corpus_index, (corpus, rows) in enumerate(pools):
        for place, batch_rows in progress(rank_batches(rows, batch_tokens, rank, world), desc=f"route {corpus}"):
            batch = collate(batch_rows)
            doc_ids = batch["doc_ids"].numpy()
            inputs = model_inputs(model, batch)
            with torch.no_grad(), autocast, capture(model, adapter) as routing:
                decoder_forward(model, inputs)  # the routers only: no output layer
            if place < 0:
                continue
            topk = [r.topk_index.cpu().numpy() for r in routing.layers]
            collector.add(corpus_index, doc_ids.reshape(-1), topk, batch=place)
            for observer in observers:
                observer.add(routing.layers, batch["doc_ids"].reshape(-1) >= 0, batch=(corpus_index, place))
            kill_point("coverage.batch")
    stats = collector.finish([name for name, _ in pools])
    if world > 1:
        parts = gather_to_main((stats, collector.first_batches()))
        if parts is None:
            return None
        stats = merge_parts(parts)
    log.info(
        "routed %d documents (%d tokens) through %d MoE layers",
        stats.num_docs,
        stats.doc_tokens.sum(),
        len(stats.layers),
    )
    return stats


def expert_load(
    model: Any,
    rows: Iterable[Mapping[str, Any]],
    batch_tokens: int,
    attn_implementation: str,
    precision: str = "fp32",
    adapter: Any = None,
) -> list[list[int]]:
    """Tokens routed to each expert of each MoE layer over ``rows`` (top-k assignments, padding excluded): the
    base routing reference of the warmup's gate (``moeflow.train.guards.base_reference``)."""
    stats = route_pool(model, [("gate window", rows)], batch_tokens, attn_implementation, precision, adapter)
    _, tokens = cell_table(stats, np.ones(stats.num_docs, dtype=bool), 0)
    return tokens.tolist()


def cell_table(stats: PoolStats, docs_mask: np.ndarray, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, E) documents with >= min_tokens tokens, and tokens, per cell, over the masked documents."""
    L, E = len(stats.layers), stats.num_experts
    keep = docs_mask[stats.cells.doc]
    tokens = np.bincount(stats.cells.code[keep], weights=stats.cells.count[keep], minlength=L * E)
    meets = keep & (stats.cells.count >= min_tokens)
    docs = np.bincount(stats.cells.code[meets], minlength=L * E)
    return docs.reshape(L, E).astype(np.int64), tokens.reshape(L, E).astype(np.int64)


def layer_health(load: Sequence[float], router_entropy: float | None = None) -> dict[str, Any]:
    """Balance statistics of one layer's expert load (top-k assignment counts)."""
    n = len(load)
    total = float(sum(load))
    mean = total / n if n else 0.0
    out: dict[str, Any] = {"load": [int(x) for x in load], "dead_experts": [i for i, x in enumerate(load) if x == 0]}
    if total <= 0:
        out.update(max_over_mean=0.0, cv=0.0, load_entropy=0.0)
    else:
        var = sum((x - mean) ** 2 for x in load) / n
        shares = [x / total for x in load if x > 0]
        entropy = -sum(p * math.log(p) for p in shares)
        out.update(
            max_over_mean=max(load) / mean,
            cv=math.sqrt(var) / mean,
            load_entropy=entropy / math.log(n) if n > 1 else 1.0,
        )
    if router_entropy is not None:
        out["router_entropy"] = float(router_entropy)
    return out
