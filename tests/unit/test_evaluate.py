"""Evaluation numbers against hand computations on a tiny model: loss is the token-normalised CE over
the whole set (not a mean of batch means), perplexity is exp(loss), per-expert loss and load are what a
token-by-token loop gives, and balance metrics are right on synthetic counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_dense_cfg, tiny_model_cfg

from moeflow.evaluation.comparison import change_record, set_comparison, summary_markdown
from moeflow.evaluation.loop import evaluate_batches
from moeflow.evaluation.run_metrics import balance, set_record
from moeflow.loading.factory import make_model
from moeflow.model.routing import adapter_for, capture
from moeflow.model.settings import ModelSettings
from moeflow.settings import typed

VOCAB = 96
TINY_MOE = tiny_model_cfg("eager", max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe():
    return make_model(typed(ModelSettings, TINY_MOE), vocab_size=VOCAB, seed=3)


def make_batches(seed: int = 0):
    """Two batches of different sizes; labels have ignored positions (document starts, padding)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, length in ((2, 16), (3, 12)):
        ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
        labels = ids.clone()
        labels[:, 0] = -100
        labels[0, 5] = -100  # a document start inside the row
        doc_ids = torch.zeros_like(ids)
        doc_ids[-1, -3:] = -1  # padding at the end of the last row
        labels[-1, -3:] = -100
        positions = torch.arange(length).repeat(rows, 1)
        out.append({"input_ids": ids, "labels": labels, "position_ids": positions, "doc_ids": doc_ids})
    return out


def test_set_loss_is_token_normalised_cross_entropy_and_perplexity_its_exp(moe):
    batches = make_batches()
    stats = evaluate_batches(moe, batches, adapter_for(moe))
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = moe(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            for row in range(logits.shape[0]):
                for t in range(logits.shape[1] - 1):
                    target = int(b["labels"][row, t + 1])
                    if target != -100:
                        total += float(-torch.log_softmax(logits[row, t].double(), -1)[target])
                        count += 1
    assert stats.label_tokens == count
    assert stats.loss == pytest.approx(total / count, rel=1e-5)
    # not the mean of per-batch means (batches have different label counts)
    per_batch = []
    with torch.no_grad():
        for b in batches:
            logits = moe(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            per_batch.append(float(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1))))
    assert abs(stats.loss - sum(per_batch) / len(per_batch)) > 1e-6
    record = set_record(stats)
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]), rel=1e-12)


def test_per_expert_load_and_served_loss_match_a_token_loop(moe):
    batches = make_batches(1)
    stats = evaluate_batches(moe, batches, adapter_for(moe))
    layers, experts = len(stats.moe_layers), 4
    routed = np.zeros((layers, experts), dtype=np.int64)
    loss_sum = np.zeros((layers, experts))
    served = np.zeros((layers, experts), dtype=np.int64)
    with torch.no_grad():
        for b in batches:
            with capture(moe) as routing:
                logits = moe(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            rows, length = b["input_ids"].shape
            for li, layer in enumerate(routing.layers):
                index = layer.topk_index.view(rows, length, -1)
                for r in range(rows):
                    for t in range(length):
                        if b["doc_ids"][r, t] < 0:
                            continue
                        for e in index[r, t].tolist():
                            routed[li, e] += 1
                            if t + 1 < length and b["labels"][r, t + 1] != -100:
                                loss_sum[li, e] += float(
                                    -torch.log_softmax(logits[r, t].double(), -1)[b["labels"][r, t + 1]]
                                )
                                served[li, e] += 1
    assert np.array_equal(stats.routed, routed)
    assert np.array_equal(stats.served_label_tokens, served)
    np.testing.assert_allclose(stats.served_loss_sum, loss_sum, rtol=1e-5)
    assert stats.input_tokens == sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    record = set_record(stats)
    layer0 = record["experts"][0]
    assert sum(layer0["share"]) == pytest.approx(1.0)
    assert layer0["mean_loss"] == pytest.approx((loss_sum[0] / served[0]).tolist(), rel=1e-5)


def test_dense_model_has_loss_but_no_expert_statistics():
    dense = make_model(typed(ModelSettings, tiny_dense_cfg("eager")), vocab_size=VOCAB, seed=0)
    stats = evaluate_batches(dense, make_batches(), adapter=None)
    record = set_record(stats)
    assert record["loss"] > 0 and "experts" not in record


def test_balance_metrics_on_synthetic_counts():
    uniform = balance([10, 10, 10, 10])
    assert uniform["max_over_mean"] == pytest.approx(1.0)
    assert uniform["cv"] == pytest.approx(0.0)
    assert uniform["load_entropy"] == pytest.approx(1.0)
    assert uniform["dead_experts"] == []
    skewed = balance([30, 10, 0, 0])
    mean = 10.0
    assert skewed["max_over_mean"] == pytest.approx(30 / mean)
    assert skewed["cv"] == pytest.approx(np.std([30, 10, 0, 0]) / mean)
    p = np.array([0.75, 0.25])
    assert skewed["load_entropy"] == pytest.approx(float(-(p * np.log(p)).sum() / math.log(4)))
    assert skewed["dead_experts"] == [2, 3]


def test_change_and_forgetting_flags():
    base = {"loss": 2.0, "perplexity": math.exp(2.0)}
    tuned = {"loss": 2.5, "perplexity": math.exp(2.5)}
    change = change_record(base, tuned)
    assert change["loss"] == pytest.approx(0.5)
    assert change["perplexity_ratio"] == pytest.approx(math.exp(0.5))


def test_summary_names_forgetting(moe):
    batches = make_batches()
    stats = evaluate_batches(moe, batches, adapter_for(moe))
    other = make_model(typed(ModelSettings, TINY_MOE), vocab_size=VOCAB, seed=4)
    worse = evaluate_batches(other, batches, adapter_for(other))
    before, after = (stats, worse) if worse.loss > stats.loss else (worse, stats)
    general = set_comparison("test/general", False, set_record(before), set_record(after))
    assert general["forgetting"]
    text = summary_markdown({"run": "moe", "sets": [general]})
    assert "Forgetting" in text and "test/general" in text.split("Forgetting", 1)[1]


def packed_documents(seed: int = 0, count: int = 7):
    gen = torch.Generator().manual_seed(seed)
    docs = [
        (1000 + i, torch.randint(1, VOCAB, (int(n),), generator=gen).tolist(), None)
        for i, n in enumerate(torch.randint(5, 30, (count,), generator=gen))
    ]
    from moeflow.data.packing import pack_documents

    return docs, list(pack_documents(iter(docs), seq_len=32, pad_to_multiple_of=8))


def test_packed_rows_evaluate_as_each_document_alone(moe):
    """Through the data stage's packing and collate: the set loss equals each packed segment (a document,
    or the part of one that a row holds) run alone."""
    from moeflow.evaluation.loop import batches

    docs, rows = packed_documents()
    assert len(rows[-1]["input_ids"]) < 32 and rows[-1]["doc_ids"][-1] == -1  # the last row is padded
    stats = evaluate_batches(moe, batches(rows, 3, "eager"), adapter_for(moe))
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            starts = np.flatnonzero(np.asarray(row["position_ids"]) == 0).tolist() + [len(row["input_ids"])]
            for lo, hi in zip(starts[:-1], starts[1:]):
                if row["doc_ids"][lo] < 0 or hi - lo < 2:
                    continue
                segment = torch.as_tensor(np.asarray(row["input_ids"][lo:hi]), dtype=torch.long)[None]
                logits = moe(input_ids=segment, use_cache=False).logits
                total += float(F.cross_entropy(logits[0, :-1], segment[0, 1:], reduction="sum"))
                count += hi - lo - 1
    assert stats.label_tokens == count
    assert stats.loss == pytest.approx(total / count, rel=1e-4)
    assert stats.input_tokens == sum(len(ids) for _, ids, _ in docs)


def test_coverage_recheck_names_cells_that_fall_below_the_threshold():
    from moeflow.evaluation.comparison import coverage_recheck

    before = {"layers": [0, 1], "docs": [[5, 5, 1, 6], [7, 7, 7, 7]]}
    after = {"layers": [0, 1], "docs": [[5, 4, 6, 6], [7, 7, 0, 7]]}
    recheck = coverage_recheck(before, after, {"min_docs_per_expert": 5, "min_tokens": 1})
    assert recheck["below_before"] == 1 and recheck["below_after"] == 2
    assert recheck["newly_below"] == [{"layer": 0, "expert": 1, "docs": 4}, {"layer": 1, "expert": 2, "docs": 0}]
    assert recheck["recovered"] == [{"layer": 0, "expert": 2, "docs": 6}]
    assert coverage_recheck(None, None, {"min_docs_per_expert": 5, "min_tokens": 1}) is None


def test_valset_coverage_counts_documents_per_expert_like_a_hand_count(moe, tmp_path):
    from moeflow.data.shards import write_split
    from moeflow.data.valset import VALSET_SPLIT, open_valset
    from moeflow.evaluation.run_metrics import valset_coverage

    docs, rows = packed_documents(2)
    write_split(tmp_path / "valset" / VALSET_SPLIT, iter(rows))
    got = valset_coverage(moe, open_valset(tmp_path / "valset"), {"batch_tokens": 64, "min_tokens": 2})
    tokens = {doc_id: np.zeros((2, 4), dtype=np.int64) for doc_id, _, _ in docs}
    with torch.no_grad():
        for row in rows:
            starts = np.flatnonzero(np.asarray(row["position_ids"]) == 0).tolist() + [len(row["input_ids"])]
            for lo, hi in zip(starts[:-1], starts[1:]):
                doc_id = int(row["doc_ids"][lo])
                if doc_id < 0:
                    continue
                with capture(moe) as routing:
                    moe(
                        input_ids=torch.as_tensor(np.asarray(row["input_ids"][lo:hi]), dtype=torch.long)[None],
                        use_cache=False,
                    )
                for li, layer in enumerate(routing.layers):
                    tokens[doc_id][li] += np.bincount(layer.topk_index.reshape(-1).numpy(), minlength=4)
    expected = sum((t >= 2).astype(np.int64) for t in tokens.values())
    assert got["documents"] == len(docs)
    assert np.array_equal(np.asarray(got["docs"]), expected)
