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
from gloo_ranks import run_ranks
from tiny_models import tiny_model_cfg

from moeflow.loading.factory import make_model
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
        process_group.destroy()


def test_two_gloo_ranks_give_the_per_parameter_sums_bit_for_bit(tmp_path):
    assert run_ranks(_rank, 2, str(tmp_path / "init")) == {0: True, 1: True}


# --------------------------------------------------------------------------- clipping sharded gradients

COLLECTIVE_NAMESPACES = {"c10d", "c10d_functional", "_c10d_functional"}


def _count_collectives():
    """A dispatch mode counting collectives (``dist.all_reduce``'s c10d op and DTensor's functional ones)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace = getattr(func, "namespace", None) or str(func).split(".")[0]
            if namespace in COLLECTIVE_NAMESPACES and not any(w in str(func) for w in ("wait", "wrap")):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return Count()


def _dtensor_api():
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.3
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    return Replicate, Shard, distribute_tensor


def _clip_rank(rank: int, world: int, init_file: str, results: dict) -> None:
    """Parameters sharded as FSDP2 and expert parallelism shard them, on two meshes (the rest's, and a 2-D
    one like the experts'), uneven and empty shards included; the norm and the clipped gradients against
    torch's clip_grad_norm_ on the whole tensors, and the collectives it took."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        Replicate, Shard, distribute_tensor = _dtensor_api()
        rest = init_device_mesh("cpu", (world,))
        experts = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        layout = [  # (shape, mesh, placements)
            ((7, 3), rest, [Shard(0)]),  # 4 + 3 rows
            ((1, 5), rest, [Shard(0)]),  # rank 1 holds no rows
            ((6, 2), rest, [Shard(0)]),
            ((5,), rest, [Replicate()]),  # a copy on every rank: counted once
            ((4, 3, 2), experts, [Replicate(), Shard(0)]),
            ((3, 4, 2), experts, [Replicate(), Shard(0)]),
            ((4,), None, None),  # a whole tensor
        ]
        g = torch.Generator().manual_seed(0)
        model, whole = torch.nn.Module(), []
        for i, (shape, mesh, placements) in enumerate(layout):
            weight, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            whole.append(torch.nn.Parameter(weight.clone()))
            whole[-1].grad = grad.clone()
            if mesh is None:
                param = torch.nn.Parameter(weight)
                param.grad = grad
            else:
                param = torch.nn.Parameter(distribute_tensor(weight, mesh, placements))
                param.grad = distribute_tensor(grad, mesh, placements)
            model.register_parameter(f"p{i}", param)
        want = float(torch.nn.utils.clip_grad_norm_(whole, 1.0, norm_type=2.0))
        counter = _count_collectives()
        with counter:
            got = gradients.clip_grad_norm(model, 1.0)
        clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        results[rank] = {
            "norm": (got, want),
            "collectives": counter.ops,
            # the meshes' groups over the sharded dimensions (torch 2.13 hands both meshes the world's group)
            "groups": len({id(rest.get_group(0)), id(experts.get_group(1))}),
            "clipped": all(torch.allclose(a, b.grad, rtol=1e-6, atol=0) for a, b in zip(clipped, whole)),
        }
    finally:
        process_group.destroy()


def test_clipping_sharded_gradients_takes_one_all_reduce_per_group_and_gives_torchs_norm(tmp_path):
    results = run_ranks(_clip_rank, 2, str(tmp_path / "init"))
    for rank, result in results.items():
        got, want = result["norm"]
        assert got == pytest.approx(want, rel=1e-6) and want > 1, rank
        assert result["clipped"], rank
        # one all-reduce per group the gradients are sharded over (the rest's mesh, the experts' sharded
        # dimension), not one per sharded gradient (5 here)
        ops = result["collectives"]
        assert len(ops) == result["groups"] and all("allreduce" in op.replace("_", "") for op in ops), result
    assert results[0]["norm"] == results[1]["norm"]


def test_a_rank_builds_its_collective_zero_on_the_device_of_the_groups_backend(monkeypatch):
    monkeypatch.setattr(process_group, "_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in [
        ("gloo", torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 3)),
        ("nccl", torch.device("cuda", 3)),
    ]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert process_group.collective_device() == device, backend
    assert process_group.collective_device.__module__ == "moeflow.parallel.process_group"


def test_an_fsdp1_rank_without_gradients_adds_its_zero_on_the_collective_device(monkeypatch):
    """A rank that holds no element of any gradient still joins the world's all-reduce, with a zero on the
    device the other ranks' squares are on (a CPU zero under NCCL would go through gloo and hang)."""
    model = model_with_gradients()
    for p in model.parameters():
        p.grad = None
    devices = []
    monkeypatch.setattr(gradients, "is_fsdp1", lambda m: True)
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(gradients, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: devices.append(tensor.device))
    assert gradients.squared_norm(model).device == torch.device("meta")
    assert devices == [torch.device("meta")]
