"""The routing-only forwards (the exact balance mode's counting forward, the coverage pool pass, the warmup
gate's base reference, which is the pool pass over the gate's window) run the decoder body alone: the output
layer and its chunked loss are never computed (about 10% of a real model's forward FLOPs), and what they count
is what a forward with the loss counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_training import make_trainer, packed_rows, settings

from moeflow.evaluation import routing_stats
from moeflow.model import chunked_loss
from moeflow.train import trainer as trainer_module


def with_the_output_layer(model, inputs):
    """The forward before: the routers' inputs are the same, the output layer runs too."""
    return model(**inputs, use_cache=False)


def head_calls(monkeypatch):
    calls = []
    original = chunked_loss._linear_losses  # what the installed forward's loss entry calls

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked_loss, "_linear_losses", counted)
    return calls


def test_the_pool_pass_reads_the_routers_without_the_output_layer(monkeypatch):
    model = make_trainer().model
    head = []
    model.lm_head.register_forward_hook(lambda *a: head.append(1))
    calls = head_calls(monkeypatch)
    rows = packed_rows(8)
    stats = routing_stats.route_pool(model, [("pool", rows)], 64, "sdpa")
    load = routing_stats.expert_load(model, rows, 64, "sdpa")  # the warmup gate's base reference
    assert calls == [] and head == []
    monkeypatch.setattr(routing_stats, "decoder_forward", with_the_output_layer)
    before = routing_stats.route_pool(model, [("pool", rows)], 64, "sdpa")
    assert head  # the full forward runs the output layer
    assert np.array_equal(stats.cells.code, before.cells.code) and np.array_equal(stats.cells.count, before.cells.count)
    assert np.array_equal(stats.pairs.count, before.pairs.count) and np.array_equal(stats.doc_tokens, before.doc_tokens)
    assert load == routing_stats.expert_load(model, rows, 64, "sdpa") and sum(map(sum, load)) > 0


def test_the_exact_modes_counting_forward_runs_no_output_layer_and_counts_the_same(monkeypatch):
    exact = settings(balance={"mode": "exact", "coef": 0.05})
    grads = {}
    for label in ("decoder only", "with the output layer"):
        t = make_trainer(seed=1, train_settings=exact)
        calls = head_calls(monkeypatch)
        if label != "decoder only":
            monkeypatch.setattr(trainer_module, "decoder_forward", with_the_output_layer)
        record = t.train_step()
        micro_batches = exact.grad_accum_steps
        if label == "decoder only":  # one loss per gradient forward, none in the counting forwards
            assert calls == [True] * micro_batches
        grads[label] = (record["loss"], record["balance_loss"], [p.detach().clone() for p in t.model.parameters()])
    (loss, balance, params), (loss0, balance0, params0) = grads.values()
    assert loss == loss0 and balance == balance0 and balance > 0
    assert all(torch.equal(a, b) for a, b in zip(params, params0))


def test_the_decoder_only_entry_takes_no_labels():
    model = make_trainer().model
    inputs = {"input_ids": torch.tensor([[3, 4, 5]])}
    out = chunked_loss.decoder_forward(model, inputs)
    assert out.last_hidden_state.shape == (1, 3, model.config.hidden_size)
    with pytest.raises(TypeError, match="decoder body alone"):
        model(**inputs, decoder_only=True, loss_labels=torch.tensor([[3, 4, 5]]))
