"""Routing drift against hand-computed references: the maths on small hand-made routings, identical models
drift by nothing, and a planted swap of two experts in one router gives a known divergence and changed fraction."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from tiny_models import tiny_dense_cfg, tiny_model_cfg

from moeflow.data.packing import pack_documents
from moeflow.evaluation import drift, token_routing
from moeflow.evaluation.loop import batches, evaluate_batches
from moeflow.loading.factory import make_model
from moeflow.model.routing import NoMoELayers, adapter_for, capture
from moeflow.model.settings import ModelSettings
from moeflow.settings import typed

VOCAB = 96
SETTINGS = {"batch_size": 3, "max_sequences": None}
SWAPPED = (0, 1)  # the experts whose router rows the planted fine-tune swaps in the last MoE layer


@pytest.fixture(scope="module")
def base():
    return make_model(
        typed(ModelSettings, tiny_model_cfg("eager", max_position_embeddings=64)), vocab_size=VOCAB, seed=5
    )


@pytest.fixture(scope="module")
def rows():
    """Packed rows of 9 documents; the last row is padded (doc_ids -1), which drift must not count."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 30, (9,), generator=gen).tolist()
    docs = [(i, torch.randint(1, VOCAB, (n,), generator=gen).tolist(), None) for i, n in enumerate(lengths)]
    packed = list(pack_documents(iter(docs), seq_len=32, pad_to_multiple_of=8))
    assert packed[-1]["doc_ids"][-1] == -1
    return packed, sum(lengths), docs


def test_js_divergence_of_hand_made_distributions():
    assert drift.js_divergence([0.25] * 4, [0.25] * 4) == 0.0
    assert drift.js_divergence([0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]) == pytest.approx(1.0)  # disjoint: 1 bit
    # m = (0.75, 0.25): KL(p||m) = 0.5 log2(2/3) + 0.5 log2(2), KL(q||m) = log2(4/3)
    expected = 0.5 * (0.5 * math.log2(2 / 3) + 0.5) + 0.5 * math.log2(4 / 3)
    assert drift.js_divergence([0.5, 0.5], [1.0, 0.0]) == pytest.approx(expected)
    assert expected == pytest.approx(0.311278, abs=1e-6)


def test_changed_set_fraction_ignores_the_order_within_the_top_k():
    def tokens(sets):
        return drift.LayerTokens(0, 4, np.sort(np.asarray(sets), axis=1), 0.0)

    base = tokens([[0, 1], [1, 2], [2, 3]])
    tuned = tokens([[1, 0], [0, 2], [2, 3]])  # token 0: the same set in another order; token 1 changed
    assert drift.changed_set_fraction(base.expert_sets, tuned.expert_sets) == pytest.approx(1 / 3)
    assert base.load_share().tolist() == [1 / 6, 2 / 6, 2 / 6, 1 / 6]


def test_experts_that_gain_or_lose_more_than_half_their_load():
    base = np.array([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    tuned = np.array([0.1, 0.3, 0.31, 0.14, 0.15, 0.0])
    gained, lost = drift.moved_experts(base, tuned)
    assert gained == [2, 4]  # 0.31 > 1.5 x 0.2; a never-chosen expert that is chosen now
    assert lost == [0]  # 0.1 < 0.5 x 0.4; 0.14 is not above 1.5 x 0.1


def test_token_entropy_in_nats():
    probs = torch.tensor([[0.25] * 4, [1.0, 0, 0, 0], [0.5, 0.5, 0, 0]])
    assert token_routing.token_entropy(probs).tolist() == pytest.approx([math.log(4), 0.0, math.log(2)])


def test_identical_models_do_not_drift(base, rows):
    packed, real_tokens, _ = rows
    routing = token_routing.model_routing(base, packed, SETTINGS, label="base")
    record = drift.drift_record(routing, token_routing.model_routing(copy.deepcopy(base), packed, SETTINGS))
    assert record["tokens"] == real_tokens  # padding excluded
    assert [layer["layer"] for layer in record["layers"]] == adapter_for(base).moe_layers
    for layer in record["layers"]:
        assert layer["js_divergence"] == 0.0 and layer["changed_expert_set_fraction"] == 0.0
        assert layer["gained"] == [] and layer["lost"] == [] and layer["entropy_change"] == 0.0
        assert 0 < layer["entropy_base"] < math.log(4)


def test_routing_runs_the_decoder_without_the_output_layer(base, rows):
    """Only the routers are read: the output layer's [batch, length, vocabulary] logits (4.6 GiB for 4 x 4,096
    tokens of Qwen3-30B-A3B in bf16) are never computed."""
    packed, _, _ = rows
    calls = []
    handle = base.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        routing = token_routing.model_routing(base, packed, SETTINGS)
    finally:
        handle.remove()
    assert routing and not calls


def test_load_is_the_evaluations_routed_share(base, rows):
    """The same loads as moeflow.evaluation.loop counts over the same batches (a second implementation)."""
    packed, _, _ = rows
    stats = evaluate_batches(base, batches(packed, 3, "eager"), adapter_for(base))
    for row, layer in enumerate(token_routing.model_routing(base, packed, SETTINGS)):
        assert layer.load_share() == pytest.approx(stats.routed[row] / stats.routed[row].sum())


def test_entropy_is_the_mean_over_the_real_tokens_each_segment_alone(base, rows):
    """Each packed segment (a document, or the part of one a row holds) routes as if alone."""
    packed, real_tokens, _ = rows
    total = np.zeros(len(adapter_for(base).sites))
    with torch.no_grad():
        for row in packed:
            starts = np.flatnonzero(np.asarray(row["position_ids"]) == 0).tolist() + [len(row["input_ids"])]
            for lo, hi in zip(starts[:-1], starts[1:]):
                if row["doc_ids"][lo] < 0:
                    continue
                with capture(base) as routing:
                    base(input_ids=torch.tensor([list(row["input_ids"][lo:hi])]), use_cache=False)
                for i, layer in enumerate(routing.layers):
                    total[i] += float(torch.special.entr(layer.probs().double()).sum())
    found = [layer.mean_entropy for layer in token_routing.model_routing(base, packed, SETTINGS)]
    assert found == pytest.approx((total / real_tokens).tolist(), rel=1e-6)


def test_a_planted_expert_swap_gives_the_known_drift(base, rows):
    packed, real_tokens, _ = rows
    tuned = copy.deepcopy(base)
    last = adapter_for(tuned).sites[-1]
    a, b = SWAPPED
    with torch.no_grad():  # swapping two router rows relabels the two experts for the router of that layer
        last.router.weight[[a, b]] = last.router.weight[[b, a]].clone()
    before = token_routing.model_routing(base, packed, SETTINGS)
    record = drift.drift_record(before, token_routing.model_routing(tuned, packed, SETTINGS))
    first, moved = record["layers"][0], record["layers"][-1]
    assert first["js_divergence"] == 0.0 and first["changed_expert_set_fraction"] == 0.0  # earlier layers: as before

    share = before[-1].load_share()
    swapped = share.copy()
    swapped[[a, b]] = share[[b, a]]
    assert moved["load_finetuned"] == pytest.approx(swapped.tolist())
    assert moved["js_divergence"] == pytest.approx(jensenshannon(share, swapped, base=2) ** 2, abs=1e-12)
    # A token's set changes exactly when it holds one of the two swapped experts, not both.
    sets = before[-1].expert_sets
    one_of_two = sum(((a in s) != (b in s)) for s in sets.tolist()) / real_tokens
    assert one_of_two > 0
    assert moved["changed_expert_set_fraction"] == pytest.approx(one_of_two)
    assert moved["entropy_change"] == pytest.approx(0.0, abs=1e-9)  # a relabelling keeps each token's entropy


def test_a_dense_model_has_no_routing_to_compare(rows):
    dense = make_model(
        typed(ModelSettings, tiny_dense_cfg("eager", max_position_embeddings=64)), vocab_size=VOCAB, seed=5
    )
    with pytest.raises(NoMoELayers, match="MoE"):
        token_routing.model_routing(dense, rows[0], SETTINGS, label="base")


@pytest.mark.parametrize("world", [4, 5])
def test_ranks_shares_in_batch_order_give_the_one_process_routing(base, rows, world):
    """Each rank routes batches rank, rank + world, ... (fillers run, not kept); put back in batch order they
    give one process's routing, entropies added in the same order (the same bits)."""
    packed, _, _ = rows
    assert len(packed) % world  # some rank runs a filler
    adapter = adapter_for(base)
    want = token_routing.route_tokens(base, batches(packed, 1, "eager"), adapter)
    shares = [batches(packed, 1, "eager", rank=r, world=world) for r in range(world)]
    parts = [token_routing.route_batches(base, share, adapter) for share in shares]
    assert sum(map(len, parts)) == len(packed)
    got = token_routing.layer_tokens(token_routing.in_batch_order(parts))
    assert [g.layer for g in got] == [w.layer for w in want]
    for g, w in zip(got, want):
        assert np.array_equal(g.expert_sets, w.expert_sets) and g.entropy_sum == w.entropy_sum


def test_a_routing_written_and_read_back_is_the_same_and_its_bytes_too(base, rows, tmp_path):
    routing = token_routing.model_routing(base, rows[0], SETTINGS)
    for name in ("a", "b"):
        drift.write_routing(tmp_path / name, routing)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    back = drift.read_routing(tmp_path / "a")
    assert [(t.layer, t.num_experts, t.entropy_sum) for t in back] == [
        (t.layer, t.num_experts, t.entropy_sum) for t in routing
    ]
    assert all(np.array_equal(b.expert_sets, t.expert_sets) for b, t in zip(back, routing))
    assert drift.drift_record(back, routing)["layers"] == drift.drift_record(routing, routing)["layers"]
    drift.write_routing(tmp_path / "dense", [])  # a dense model's file: no layer
    assert drift.read_routing(tmp_path / "dense") == []
