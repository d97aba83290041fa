"""ESFT expert relevance and per-layer selection against hand computations on planted routing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeflow.train.esft import TotalsCollector, select_experts, select_layer


def planted_layer(index, weight):
    return SimpleNamespace(topk_index=torch.tensor(index), topk_weight=torch.tensor(weight, dtype=torch.float64))


def planted_totals():
    """4 experts, top-2, 4 real tokens and 1 padding token (whose routing must not count)."""
    index = [[0, 1], [0, 2], [0, 1], [3, 0], [3, 2]]
    weight = [[3.0, 1.0], [1.0, 1.0], [2.0, 2.0], [1.0, 3.0], [9.0, 9.0]]  # unnormalised (routed scaling)
    keep = torch.tensor([True, True, True, True, False])
    collector = TotalsCollector([1], num_experts=4, top_k=2)
    collector.add([planted_layer(index, weight)], keep)
    return collector.finish()


def test_token_and_gate_scores_equal_the_hand_computation():
    totals = planted_totals()
    assert totals.tokens == 4
    # selections over the 4 real tokens: e0 x4, e1 x2, e2 x1, e3 x1, of 8
    assert totals.scores("token")[0].tolist() == [4 / 8, 2 / 8, 1 / 8, 1 / 8]
    # normalised weights: t0 (.75 e0, .25 e1), t1 (.5 e0, .5 e2), t2 (.5 e0, .5 e1), t3 (.25 e3, .75 e0)
    np.testing.assert_allclose(
        totals.scores("gate")[0], [(0.75 + 0.5 + 0.5 + 0.75) / 4, 0.75 / 4, 0.5 / 4, 0.25 / 4], rtol=0, atol=1e-15
    )
    for score in ("token", "gate"):
        assert totals.scores(score).sum() == pytest.approx(1.0)


def test_selection_per_score_and_its_json():
    totals = planted_totals()
    # token: 0.5, 0.25, 0.125 (e2), 0.125 (e3): top_p .5 -> {0}; .6 -> {0, 1}; .8 -> {0,1,2} (tie: lower index)
    assert [select_layer(totals.scores("token")[0], p) for p in (0.5, 0.6, 0.8, 1.0)] == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
    ]
    # gate: 0.625, 0.1875, 0.125, 0.0625: .7 -> {0, 1}; .8125 (exact sum) -> {0, 1}; .82 -> {0, 1, 2}
    gate = totals.scores("gate")[0]
    assert [select_layer(gate, p) for p in (0.6, 0.7, 0.8125, 0.82)] == [[0], [0, 1], [0, 1], [0, 1, 2]]
    chosen = select_experts(totals, "gate", 0.7)
    assert chosen["layers"] == [{"layer": 1, "scores": gate.tolist(), "selected": [0, 1]}]
    assert (chosen["score"], chosen["top_p"], chosen["tokens"], chosen["top_k"]) == ("gate", 0.7, 4, 2)


def test_ties_break_by_lower_expert_index():
    assert select_layer(np.array([0.25, 0.25, 0.25, 0.25]), 0.3) == [0, 1]
    assert select_layer(np.array([0.1, 0.4, 0.4, 0.1]), 0.5) == [1, 2]
    assert select_layer(np.array([0.4, 0.1, 0.1, 0.4]), 0.45) == [0, 3]


def test_bad_settings_are_refused_with_the_key():
    totals = planted_totals()
    with pytest.raises(ValueError, match="train.esft.score"):
        totals.scores("mean")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="train.esft.top_p"):
            select_layer(totals.scores("token")[0], bad)


def task_documents(count: int = 6) -> list[dict]:
    """``count`` one-document rows of 5-19 tokens in the data stage's format."""
    rng = np.random.default_rng(0)
    rows = []
    for doc in range(count):
        n = int(rng.integers(5, 20))
        rows.append(
            {
                "input_ids": rng.integers(0, 64, n).tolist(),
                "labels": rng.integers(0, 64, n).tolist(),
                "position_ids": list(range(n)),
                "doc_ids": [doc] * n,
            }
        )
    return rows


def test_routing_pass_observer_matches_the_pool_statistics():
    """The totals come from the coverage stage's own routing pass and agree with its per-expert load."""
    from tiny_models import build_family

    from moeflow.evaluation.routing_stats import cell_table, route_pool
    from moeflow.model.routing import adapter_for

    model = build_family("qwen3_moe", dtype=torch.float32)
    rows = task_documents()
    adapter = adapter_for(model)
    collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)
    stats = route_pool(model, [("task", rows)], 40, "eager", observers=[collector])
    totals = collector.finish()
    _, load = cell_table(stats, np.ones(stats.num_docs, dtype=bool), 0)
    assert totals.tokens == sum(len(r["input_ids"]) for r in rows)
    assert (totals.selections == np.asarray(load)).all()
    np.testing.assert_allclose(totals.gate_sums.sum(axis=1), totals.tokens, rtol=1e-9)


def test_two_fsdp_ranks_give_one_processes_totals_bit_for_bit(tmp_path):
    """Rule esft_routing on coverage.ranks ranks: each routes its share of the batches in an FSDP layout, rank 0 adds
    every rank's batches in their order: the same JSON as one process (gate sums to the last digit)."""
    import json

    from gloo_ranks import run_ranks
    from tiny_models import tiny_model_cfg

    from moeflow.evaluation.routing_stats import route_pool
    from moeflow.loading.factory import make_model
    from moeflow.model.routing import adapter_for
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed
    from moeflow.train.esft import totals_json

    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=64, seed=0)
    adapter = adapter_for(model)
    collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)
    route_pool(model, [("task", task_documents(20))], 40, "sdpa", observers=[collector])
    results = run_ranks(_routing_rank, str(tmp_path), timeout_s=300)
    assert json.dumps(results["totals"]) == json.dumps(totals_json(collector.finish()))
    assert results["forwards"][0] == results["forwards"][1] > 0  # in step: a rank short of batches ran fillers


def _routing_rank(rank: int, root: str, results: dict) -> None:
    from gloo_ranks import fsdp_layout, gloo_group
    from tiny_models import tiny_model_cfg

    from moeflow.evaluation.routing_stats import route_pool
    from moeflow.loading.factory import make_model
    from moeflow.model.routing import adapter_for
    from moeflow.model.settings import ModelSettings
    from moeflow.parallel.process_group import gather_to_main
    from moeflow.settings import typed
    from moeflow.train.esft import totals_json

    torch.set_num_threads(1)
    with gloo_group(rank, root) as ranks:
        model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=64, seed=0, layout=fsdp_layout(ranks))
        adapter = adapter_for(model)
        collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)
        forwards = []
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        route_pool(model, [("task", task_documents(20))], 40, "sdpa", adapter, observers=[collector], ranks=ranks)
        parts = gather_to_main(collector.batches)
        every = gather_to_main(len(forwards))
        if parts is not None:
            results["totals"] = totals_json(collector.finish(parts))
            results["forwards"] = every
