"""Coverage: per-document routing statistics, the greedy multi-cover, infeasibility, the random comparison,
the heatmap, and the stage end to end on a tiny model (valset disjoint from the training shards)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import run_coverage_stage
from tiny_models import FAMILIES, MOE_LAYERS, TRANSFORMERS_5_ONLY, model_config

from moeflow.coverage.bitsets import masked_popcounts, pack_word_bits, unpack_word_bits
from moeflow.coverage.cover import (
    Constraints,
    CoverageInfeasible,
    build_constraints,
    coverage_report,
    fill_to_distribution,
    greedy_multicover,
    infeasible_message,
    seeded_rank,
    select_documents,
    top_pairs,
    unmet_constraints,
)
from moeflow.coverage.heatmap import coverage_heatmap
from moeflow.data.valset import open_valset
from moeflow.evaluation.routing_stats import PoolStats, StatsCollector, cell_table, merge_parts, route_pool
from moeflow.runtime import compat

LAYERS, E, K = [1, 3], 8, 2


def synthetic_routing(num_docs: int, seed: int, dead_expert: tuple[int, int] | None = None):
    """Token-level routing of a pool: {doc_id: [(T, K) expert choices per layer]} with skewed popularity."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** 1.3
    docs = {}
    for d in range(num_docs):
        n = int(rng.integers(3, 40))
        per_layer = []
        for position in range(len(LAYERS)):
            p = popularity[rng.permutation(E)] if d % 3 else popularity.copy()
            if dead_expert and dead_expert[0] == position:
                p[dead_expert[1]] = 0.0
            p = p / p.sum()
            per_layer.append(np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(n)]))
        docs[1000 + 7 * d] = per_layer
    return docs


def collect(docs, batch_tokens: int = 50) -> PoolStats:
    """Feed the collector as packed batches would: docs split across batches, padding (-1) between."""
    collector = StatsCollector(LAYERS, E, K)
    doc_ids = np.concatenate([np.full(len(r[0]), d) for d, r in docs.items()] + [np.full(5, -1)])
    routes = [
        np.concatenate([r[p] for r in docs.values()] + [np.zeros((5, K), dtype=np.int64)]) for p in range(len(LAYERS))
    ]
    for start in range(0, len(doc_ids), batch_tokens):
        sl = slice(start, start + batch_tokens)
        collector.add(0, doc_ids[sl], [r[sl] for r in routes])
    return collector.finish(["pool"])


def truth(docs):
    """Per document: Counter of (layer position, expert) and of (layer position, lo, hi) from the tokens."""
    cells, pairs = {}, {}
    for d, per_layer in docs.items():
        cells[d], pairs[d] = Counter(), Counter()
        for position, choices in enumerate(per_layer):
            for row in choices.tolist():
                cells[d].update((position, e) for e in row)
                pairs[d].update((position, *sorted(ab)) for ab in itertools.combinations(row, 2))
    return cells, pairs


def test_collector_counts_match_the_tokens_and_merge_across_batches():
    docs = synthetic_routing(20, seed=1)
    stats = collect(docs, batch_tokens=17)
    cells, pairs = truth(docs)
    assert stats.doc_id.tolist() == list(docs)
    assert stats.doc_tokens.tolist() == [len(r[0]) for r in docs.values()]
    got_cells = Counter(
        {
            (int(stats.doc_id[d]), int(c) // E, int(c) % E): int(n)
            for d, c, n in zip(stats.cells.doc, stats.cells.code, stats.cells.count)
        }
    )
    assert got_cells == Counter({(d, p, e): n for d, cnt in cells.items() for (p, e), n in cnt.items()})
    got_pairs = Counter(
        {
            (int(stats.doc_id[d]), int(c) // (E * E), int(c) % (E * E) // E, int(c) % E): int(n)
            for d, c, n in zip(stats.pairs.doc, stats.pairs.code, stats.pairs.count)
        }
    )
    assert got_pairs == Counter({(d, *key): n for d, cnt in pairs.items() for key, n in cnt.items()})


def pool_batches(seed: int, batch_tokens: int = 23):
    """``(corpus, place, doc_ids, routes)`` of two corpora's packed batches: doc ids out of order, documents
    spanning batches, padding at each corpus's end."""
    batches = []
    for corpus in range(2):
        docs = synthetic_routing(12, seed=seed + corpus)
        ids = np.random.default_rng(seed).permutation(len(docs)) * 3 + 5  # appearance order is not id order
        doc_ids = np.concatenate([np.full(len(r[0]), i) for i, r in zip(ids, docs.values())] + [np.full(4, -1)])
        routes = [
            np.concatenate([r[p] for r in docs.values()] + [np.zeros((4, K), dtype=np.int64)])
            for p in range(len(LAYERS))
        ]
        for place, start in enumerate(range(0, len(doc_ids), batch_tokens)):
            sl = slice(start, start + batch_tokens)
            batches.append((corpus, place, doc_ids[sl], [r[sl] for r in routes]))
    return batches


@pytest.mark.parametrize("world", [2, 3, 40])
def test_ranks_parts_merge_into_the_one_process_statistics(world):
    """Each rank collects batches rank, rank + world, ... of each pool (route_pool's share); merge_parts gives
    the statistics one collector gets from every batch in order: the same documents in the same order (the
    selection's tie-breaks follow it), the same counts. world 40 leaves ranks without a batch."""
    batches = pool_batches(seed=3)
    one = StatsCollector(LAYERS, E, K)
    for corpus, place, doc_ids, routes in batches:
        one.add(corpus, doc_ids, routes, batch=place)
    want = one.finish(["a", "b"])
    parts = []
    for rank in range(world):
        part = StatsCollector(LAYERS, E, K)
        for corpus, place, doc_ids, routes in batches:
            if place % world == rank:
                part.add(corpus, doc_ids, routes, batch=place)
        parts.append((part.finish(["a", "b"]), part.first_batches()))
    got = merge_parts(parts)
    assert want.doc_id[:12].tolist() != sorted(want.doc_id[:12].tolist())  # the order is not the ids'
    for name in ("doc_corpus", "doc_id", "doc_tokens"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    for name in ("cells", "pairs"):
        for field in ("doc", "code", "count"):
            assert np.array_equal(getattr(getattr(got, name), field), getattr(getattr(want, name), field)), name
    assert (got.corpora, got.layers, got.num_experts, got.top_k) == (want.corpora, want.layers, E, K)


@pytest.mark.parametrize(("batches", "world"), [(7, 2), (7, 3), (2, 3), (0, 2), (6, 3)])
def test_each_rank_runs_as_many_forwards_and_the_ranks_count_each_batch_once(batches, world):
    """A sharded model's forward is a collective: every rank the same number of forwards, the fillers
    (place -1, the pool's first batch) not counted, every batch counted by one rank."""
    from moeflow.evaluation.routing_stats import rank_batches

    rows = [{"input_ids": [i] * 10} for i in range(batches)]  # 10 tokens a row: one row a batch
    shares = [list(rank_batches(rows, 10, rank, world)) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1
    counted = sorted(place for share in shares for place, _ in share if place >= 0)
    assert counted == list(range(batches))
    assert all(batch == [rows[0]] for share in shares for place, batch in share if place < 0)
    assert all(batch == [rows[place]] for share in shares for place, batch in share if place >= 0)


def test_top_pairs_are_the_most_frequent_per_layer():
    docs = synthetic_routing(30, seed=2)
    stats = collect(docs)
    _, pairs = truth(docs)
    totals = Counter()
    for cnt in pairs.values():
        totals.update(cnt)
    top = top_pairs(stats, 3)
    for position in range(len(LAYERS)):
        ranked = sorted(((n, (a, b)) for (p, a, b), n in totals.items() if p == position), key=lambda x: (-x[0], x[1]))
        assert [tuple(x) for x in top[position].tolist()] == [ab for _, ab in ranked[:3]]


def exact_greedy(meets: np.ndarray, demand: np.ndarray, cost: np.ndarray, budget: int, rank: np.ndarray) -> list[int]:
    """The plain greedy, recounting every gain from the dense matrix at every step."""
    demand, remaining, picked = demand.copy(), budget, []
    available = np.ones(len(cost), dtype=bool)
    while True:
        gains = (meets & (demand > 0)).sum(axis=1)
        score = np.where(available & (cost <= remaining) & (gains > 0), gains * (1.0 / np.maximum(cost, 1)), -1.0)
        if score.max() <= 0:
            return picked
        ties = np.flatnonzero(score == score.max())
        j = int(ties[np.argmin(rank[ties])])
        picked.append(j)
        demand[meets[j] & (demand > 0)] -= 1
        available[j] = False
        remaining -= int(cost[j])


@pytest.mark.parametrize("seed", range(6))
def test_lazy_greedy_picks_what_the_plain_greedy_picks(seed):
    rng = np.random.default_rng(seed)
    docs, constraints = 300, 150
    popularity = rng.random(constraints) ** 3
    meets = rng.random((docs, constraints)) < popularity
    cost = rng.integers(1, 6, docs)  # small costs: many ties in gain per token
    demand = np.minimum(meets.sum(axis=0), 3)
    rank = seeded_rank(docs, seed)
    budget = int(cost.sum() // 4)
    words = pack_word_bits(meets)
    picked, left = greedy_multicover(words, demand, cost, budget, rank, refresh=16, hot_size=64)
    assert picked.tolist() == exact_greedy(meets, demand, cost, budget, rank)
    assert np.array_equal(left, np.maximum(demand - meets[picked].sum(axis=0), 0))


def test_packed_bits_roundtrip():
    rng = np.random.default_rng(0)
    meets = rng.random((7, 130)) < 0.3
    words = pack_word_bits(meets)
    assert words.shape == (7, 3) and words.dtype == np.uint64
    assert all(np.array_equal(unpack_word_bits(words[i], 130), meets[i]) for i in range(7))
    constraints = Constraints.from_dense(meets, 2, 65, np.zeros((2, 0, 2), dtype=np.int64))
    assert np.array_equal(constraints.column_counts(np.arange(7)), meets.sum(axis=0))
    assert np.array_equal(masked_popcounts(words, pack_word_bits(np.arange(130) % 2 == 0)), meets[:, ::2].sum(axis=1))


SETTINGS = {
    "pool_corpora": ["pool"],
    "min_docs_per_expert": 3,
    "min_tokens": 2,
    "pairs_per_layer": 2,
    "token_budget": 600,
    "batch_tokens": 64,
    "allow_unmet": False,
    "random_draws": 4,
}


def select(stats, settings=SETTINGS, seed=0):
    constraints = build_constraints(stats, settings["min_tokens"], settings["pairs_per_layer"])
    selection = select_documents(
        constraints, stats.doc_tokens, stats.doc_corpus, settings["min_docs_per_expert"], settings["token_budget"], seed
    )
    return constraints, selection


def test_selection_meets_every_constraint_within_budget_and_is_seed_deterministic():
    docs = synthetic_routing(120, seed=3)
    stats = collect(docs)
    constraints, selection = select(stats)
    cells, pairs = truth(docs)
    chosen = [int(stats.doc_id[j]) for j in selection.selected]
    assert len(set(chosen)) == len(chosen)
    assert selection.tokens == sum(len(docs[d][0]) for d in chosen) <= SETTINGS["token_budget"]
    # Every (layer, expert): >= min_docs chosen documents with >= min_tokens tokens, checked on the tokens.
    for position, e in itertools.product(range(len(LAYERS)), range(E)):
        assert sum(cells[d][(position, e)] >= 2 for d in chosen) >= 3, (position, e)
    for position in range(len(LAYERS)):
        for a, b in constraints.pair_experts[position].tolist():
            assert sum(pairs[d][(position, a, b)] >= 2 for d in chosen) >= 3
    # The fill used the budget: no unselected document would still fit.
    left = SETTINGS["token_budget"] - selection.tokens
    unselected = np.setdiff1d(np.arange(stats.num_docs), selection.selected)
    assert selection.greedy_count < len(selection.selected)
    assert stats.doc_tokens[unselected].min() > left
    again = select(stats)[1]
    assert np.array_equal(again.selected, selection.selected)
    others = [select(stats, seed=s)[1].selected for s in (1, 2, 3)]
    assert any(not np.array_equal(o, selection.selected) for o in others)


def test_fill_keeps_each_pool_corpus_share():
    rng = np.random.default_rng(0)
    cost = rng.integers(5, 30, 400)
    group = (np.arange(400) >= 100).astype(np.int64)  # corpus 0: a quarter of the documents
    added = fill_to_distribution(np.zeros(0, dtype=np.int64), cost, group, 2000, seeded_rank(400, 0))
    share = cost[added][group[added] == 0].sum() / cost[added].sum()
    pool_share = cost[group == 0].sum() / cost.sum()
    assert abs(share - pool_share) < 0.03 and cost[added].sum() <= 2000


def test_an_expert_no_document_routes_to_fails_naming_it_and_the_option(tmp_path):
    docs = synthetic_routing(60, seed=4, dead_expert=(1, 5))
    stats = collect(docs)
    constraints, selection = select(stats)
    unmet = unmet_constraints(constraints, stats.layers, selection, SETTINGS["min_docs_per_expert"])
    assert {"layer": 3, "constraint": "expert 5", "docs": 0, "pool_docs": 0, "reason": "pool"} in unmet
    message = infeasible_message(unmet, 3, 2)
    assert "layer 3: expert 5 (0 in pool, 0 selected)" in message
    assert "coverage.allow_unmet: true" in message
    report, _ = coverage_report(stats, constraints, selection, SETTINGS, seed=0)
    assert report["unmet"] == unmet
    assert report["layers"][1]["docs"][5] == 0 and report["layers"][1]["pool_docs"][5] == 0


def test_a_budget_too_small_is_reported_as_such():
    docs = synthetic_routing(80, seed=5)
    stats = collect(docs)
    constraints, selection = select(stats, SETTINGS | {"token_budget": 60})
    unmet = unmet_constraints(constraints, stats.layers, selection, 3)
    assert unmet and {u["reason"] for u in unmet} == {"token_budget"}
    assert "raise 'coverage.token_budget'" in infeasible_message(unmet, 3, 2)
    assert selection.tokens <= 60


def test_report_and_random_comparison():
    docs = synthetic_routing(150, seed=6)
    stats = collect(docs)
    constraints, selection = select(stats, SETTINGS | {"token_budget": 500})
    report, heat = coverage_report(stats, constraints, selection, SETTINGS | {"token_budget": 500}, seed=0)
    assert report["valset"]["docs"] == len(selection.selected) and report["valset"]["cells_below"] == 0
    assert [layer["layer"] for layer in report["layers"]] == LAYERS
    docs_table, tokens_table = cell_table(stats, selection.selected_mask(stats.num_docs), 2)
    assert report["layers"][0]["tokens"] == tokens_table[0].tolist()
    assert tokens_table.sum() == selection.tokens * K * len(LAYERS)
    comparison = report["random_comparison"]
    assert comparison["draws"] == 4 and len(comparison["per_draw"]) == 4
    for draw in comparison["per_draw"]:
        assert draw["tokens"] <= selection.tokens
    first = comparison["per_draw"][0]
    assert first["cells_below"] == int((heat["random"] < 3).sum())
    assert np.array_equal(heat["valset"], docs_table)
    json.dumps(report)  # plain JSON types only


def test_heatmap_is_a_deterministic_png(tmp_path):
    valset = np.array([[3, 5, 0, 9], [4, 4, 1, 2]])
    random = np.array([[0, 1, 2, 3], [3, 3, 3, 3]])
    coverage_heatmap(tmp_path / "a.png", [1, 3], valset, random, 3)
    coverage_heatmap(tmp_path / "b.png", [1, 3], valset, random, 3)
    data = (tmp_path / "a.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data == (tmp_path / "b.png").read_bytes()
    assert b"matplotlib" not in data


# --------------------------------------------------------------------------- the stage, end to end


def test_stage_writes_a_disjoint_covering_valset(coverage_inputs, tmp_path):
    from moeflow.data.shards import open_split, read_documents

    root, model_cfg = coverage_inputs
    report, outputs = run_coverage_stage(root, model_cfg, tmp_path / "a")
    valset_docs = dict(read_documents(open_valset(outputs.valset)))
    heldout = dict(read_documents(open_split(root / "code", "heldout")))
    train_ids = {d for d, _ in read_documents(open_split(root / "code", "train"))}
    assert valset_docs and not (set(valset_docs) & train_ids)
    assert all(heldout[d] == ids for d, ids in valset_docs.items())
    assert report["valset"]["docs"] == len(valset_docs) and report["valset"]["tokens"] == sum(
        map(len, valset_docs.values())
    )
    assert report["valset"]["tokens"] <= 1500 and report["unmet"] == [] and report["valset"]["cells_below"] == 0
    assert all(min(layer["docs"]) >= 2 for layer in report["layers"])
    assert json.loads(Path(outputs.json).read_text()) == report
    manifest = json.loads((Path(outputs.valset) / "manifest.json").read_text())
    assert manifest["docs"] == len(valset_docs) and manifest["seq_len"] == 64
    # Same inputs and seed: the same bytes.
    run_coverage_stage(root, model_cfg, tmp_path / "b")
    for name in ("coverage.json", "heatmap.png", "valset/heldout/shard-00000.arrow", "valset/manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_stage_statistics_match_routing_each_document_alone(coverage_inputs):
    """Packed documents are masked from each other: routing a document alone gives the same counts."""
    import torch

    from moeflow.data.shards import iter_rows, open_split, read_documents
    from moeflow.loading.factory import make_model
    from moeflow.model.routing import capture
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    root, model_cfg = coverage_inputs
    model = make_model(typed(ModelSettings, model_cfg), folder=root / "base").eval()
    rows = list(iter_rows(open_split(root / "code", "heldout")))[:8]
    stats = route_pool(model, [("code", rows)], 128, model_cfg["attn_implementation"])
    docs = dict(read_documents(open_split(root / "code", "heldout")))
    segments = Counter(int(row["doc_ids"][i]) for row in rows for i in np.flatnonzero(row["position_ids"] == 0))
    whole = [
        j
        for j, d in enumerate(stats.doc_id.tolist())  # not split across rows
        if segments[d] == 1 and len(docs[d]) == stats.doc_tokens[j]
    ]
    later = {int(row["doc_ids"][i]) for row in rows for i in np.flatnonzero(row["position_ids"] == 0) if i > 0}
    assert len(whole) >= 3 and any(int(stats.doc_id[j]) in later for j in whole)  # some follow another document
    for j in whole:
        ids = torch.tensor([docs[int(stats.doc_id[j])]])
        with torch.no_grad(), capture(model) as routing:
            model(input_ids=ids, use_cache=False)
        alone = Counter()
        for position, layer in enumerate(routing.layers):
            alone.update(position * 4 + e for e in layer.topk_index.flatten().tolist())
        mine = stats.cells.doc == j
        assert Counter(dict(zip(stats.cells.code[mine].tolist(), stats.cells.count[mine].tolist()))) == alone


def test_stage_fails_on_an_unmet_constraint_unless_allowed(coverage_inputs, tmp_path):
    root, model_cfg = coverage_inputs
    with pytest.raises(CoverageInfeasible, match=r"(?s)layer \d: expert \d.*coverage.allow_unmet: true"):
        run_coverage_stage(root, model_cfg, tmp_path / "a", min_docs_per_expert=10_000)
    assert not (tmp_path / "a" / "coverage.json").exists() and not (tmp_path / "a" / "valset").exists()
    report, _ = run_coverage_stage(root, model_cfg, tmp_path / "b", min_docs_per_expert=10_000, allow_unmet=True)
    assert report["unmet"] and all(u["reason"] == "pool" for u in report["unmet"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stage_covers_every_expert_of_every_family(coverage_inputs, tmp_path, family):
    """The coverage stage on each family's tiny model (moved here from tests/pipeline/test_user_models.py, whose
    runs share the first family's validation set): every MoE layer of the family is reported, and every expert
    of it is met by the validation set."""
    from moeflow.data.tokenizer import load_fast_tokenizer
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    if family in TRANSFORMERS_5_ONLY and not compat.is_transformers_v5():
        pytest.skip(f"{family} needs transformers 5 (the current stack)")
    root, _ = coverage_inputs
    model_cfg = model_config(family)
    (tmp_path / "code").symlink_to(root / "code")
    model = make_model(typed(ModelSettings, model_cfg), vocab_size=len(load_fast_tokenizer(root / "tokenizer")), seed=0)
    model.save_pretrained(tmp_path / "base")
    report, outputs = run_coverage_stage(tmp_path, model_cfg, tmp_path / "out", min_docs_per_expert=1)
    config = model_cfg["config"]
    (experts,) = {config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config}
    assert [layer["layer"] for layer in report["layers"]] == MOE_LAYERS.get(family, [0, 1])
    assert report["unmet"] == [] and report["valset"]["docs"] > 0
    assert all(len(layer["docs"]) == experts and min(layer["docs"]) >= 1 for layer in report["layers"])
