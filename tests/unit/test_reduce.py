"""Gradient reduction of an unsharded model (``parallel.strategy: none``, LoRA): one all-reduce per bucket.

* With ``torch.distributed.all_reduce`` counted (and standing in for two ranks with equal gradients), a
  step takes one all-reduce to agree on which gradients exist plus ceil(bytes / bucket) for the gradients,
  and the gradients are those of the per-parameter reduction.
* On two real gloo ranks, buckets split across parameters give bit for bit the per-parameter sums.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_models import tiny_model_cfg

from moeflow.model.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel import gradients, process_group
from moeflow.parallel.gradients import GRADIENT_BUCKET_BYTES, reduce_gradients
from moeflow.settings import typed

VOCAB = 97


def model_with_gradients(seed: int = 0) -> torch.nn.Module:
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return model


@pytest.mark.parametrize("bucket_bytes", [1000, 4096 * 4 + 12, GRADIENT_BUCKET_BYTES])
def test_one_all_reduce_per_bucket_and_the_per_parameter_result(monkeypatch, bucket_bytes):
    model = model_with_gradients()
    want = {n: 2 * p.grad for n, p in model.named_parameters()}
    calls = []

    def two_equal_ranks(tensor, op=None, **kwargs):
        calls.append(tensor.numel())
        tensor.mul_(2)

    monkeypatch.setattr(gradients, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "world_size", lambda: 2)  # all_reduce_sum asks it too
    monkeypatch.setattr(dist, "all_reduce", two_equal_ranks)
    reduce_gradients(model, bucket_bytes)

    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(calls) == 1 + math.ceil(grad_bytes / bucket_bytes), calls
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want[name]), name


def test_a_gradient_missing_on_this_rank_is_reduced_as_zeros_and_one_missing_everywhere_stays_none(monkeypatch):
    model = model_with_gradients()
    params = list(model.parameters())
    params[3].grad = None  # the other rank has it
    params[5].grad = None  # no rank has it
    missing_everywhere = id(params[5])

    def two_ranks(tensor, op=None, **kwargs):
        if tensor.dtype == torch.float64:  # the presence vector: the other rank has all but params[5]
            other = torch.ones_like(tensor)
            other[5] = 0
            tensor.add_(other)
        else:
            tensor.mul_(2)

    monkeypatch.setattr(gradients, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "world_size", lambda: 2)  # all_reduce_sum asks it too
    monkeypatch.setattr(dist, "all_reduce", two_ranks)
    reduce_gradients(model, 1000)
    assert params[3].grad is not None and torch.equal(params[3].grad, torch.zeros_like(params[3]))
    assert all((p.grad is None) == (id(p) == missing_everywhere) for p in params)


def _rank(rank: int, world: int, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bucketed, reference = model_with_gradients(seed=rank), model_with_gradients(seed=rank)
        reduce_gradients(bucketed, bucket_bytes=1000)  # small buckets: most parameters are split
        for p in reference.parameters():
            dist.all_reduce(p.grad)
        results[rank] = all(torch.equal(a.grad, b.grad) for a, b in zip(bucketed.parameters(), reference.parameters()))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_per_parameter_sums_bit_for_bit(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
        assert dict(results) == {0: True, 1: True}
