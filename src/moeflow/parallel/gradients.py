"""Gradients across ranks: the data-parallel sum, clipping over every layout, FSDP1's flat gradients.

The sum is over data-parallel ranks (the losses are normalised by the step's global token count); FSDP1's flat
gradients are released between steps.
"""

from __future__ import annotations

import torch

from moeflow.model.parameters import clean_name
from moeflow.model.wrappers import is_fsdp1, unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.layouts import is_sharded
from moeflow.parallel.process_group import all_reduce_sum, collective_device, world_size

GRADIENT_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket size


def reduce_gradients(model: torch.nn.Module, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Make every rank's gradients the step's summed gradient (the losses are normalised globally).

    Unsharded model: all-reduce (sum) in buckets of ``bucket_bytes`` (:func:`sum_in_buckets`). Sharded:
    FSDP has already reduce-scattered the mean over the data-parallel ranks, so multiply by their number."""
    world = world_size()
    if world == 1:
        return
    if not is_sharded(model):
        params = [p for p in model.parameters() if p.requires_grad]
        # A rank whose tokens missed an expert has no gradient for it (transformers 4.57 runs only the
        # experts that got tokens): agree first on which gradients exist anywhere, so that every rank
        # fills the same buckets in the same order, and a gradient no rank has stays None.
        present = all_reduce_sum(torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64))
        grads = []
        for p, anywhere in zip(params, present.tolist()):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()  # bucketed through a flat view
                grads.append(p.grad)
        sum_in_buckets(grads, bucket_bytes)
        return
    data_parallel = _data_parallel_size(model, world)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(data_parallel)


def sum_in_buckets(tensors: list[torch.Tensor], bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Sum contiguous tensors over ranks in place, in one all-reduce per bucket instead of one per tensor
    (a model's thousands of gradients: ~19k collectives a step on Qwen3-30B-A3B).

    Tensors of one dtype and device are copied, in order, into a flat buffer of ``bucket_bytes``, split
    across bucket boundaries where they do not fit, so a group of B bytes takes ceil(B / bucket_bytes)
    all-reduces; each reduced bucket is copied back. An element-wise sum: the same values as summing
    tensor by tensor. Every rank must pass the same shapes in the same order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.view(-1))
    for (dtype, device), flats in groups.items():
        capacity = max(1, bucket_bytes // dtype.itemsize)
        bucket = torch.empty(min(capacity, sum(f.numel() for f in flats)), dtype=dtype, device=device)
        pieces: list[tuple[torch.Tensor, int, int, int]] = []  # (flat tensor, its offset, bucket offset, length)
        filled = 0
        for flat in flats:
            start = 0
            while start < flat.numel():
                length = min(capacity - filled, flat.numel() - start)
                bucket[filled : filled + length].copy_(flat[start : start + length])
                pieces.append((flat, start, filled, length))
                filled += length
                start += length
                if filled == capacity:
                    _sum_bucket(bucket, filled, pieces)
                    pieces, filled = [], 0
        if filled:
            _sum_bucket(bucket, filled, pieces)


def _sum_bucket(bucket: torch.Tensor, filled: int, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
    """All-reduce the bucket's first ``filled`` elements and copy each piece back where it came from."""
    all_reduce_sum(bucket[:filled])
    for flat, start, offset, length in pieces:
        flat[start : start + length].copy_(bucket[offset : offset + length])


def fill_missing_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter that has no gradient a zero one, so that the optimizer steps every
    parameter every step, in every layout: an expert no token of the step reached has no gradient in one process
    of transformers 4.57 (it runs only the experts that got tokens), while FSDP1's flat gradient holds zeros for
    it and transformers 5's fused expert tensors hold zero rows. AdamW would skip it in the first case only (no
    momentum, no decay), and the same run would train differently on 1 rank and on 2. FSDP1's own parameters
    are left alone: their gradients are views of its flat gradient."""
    if is_fsdp1(model):
        return
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)


def release_gradients(model: torch.nn.Module) -> None:
    """Free FSDP1's flat gradients once ``zero_grad(set_to_none=True)`` has dropped the parameters' own:
    FSDP1 (torch 2.3) otherwise keeps each unit's gradient shard until the next forward, one more copy of
    the rank's weights through every checkpoint, evaluation and export between steps. Other layouts: the
    parameters' gradients are the gradients, already freed."""
    if not is_fsdp1(model):
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in model.modules():
        if isinstance(unit, FullyShardedDataParallel) and unit._handle is not None:
            unit._handle._reset_flat_param_grad_info_if_needed()


def _data_parallel_size(model: torch.nn.Module, world: int) -> int:
    """Ranks that see different data: all of them, but for transformers' tensor/pipeline parallel sizes."""
    config = getattr(unwrap(model), "config", None)
    dcfg = getattr(config, "distributed_config", None)
    if dcfg is not None and getattr(dcfg, "dp_size", None):
        return int(dcfg.dp_size)
    return world


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients of the whole (sharded) model to ``max_norm``; return the norm before clipping.

    Sharded models (:func:`squared_norm`): each rank's local squared norms summed in parameter order, then
    one all-reduce per process group the gradients are sharded over (FSDP1: the world; DTensors: their
    meshes' sharded dimensions, the experts' and the rest's): a handful of collectives a step where a
    ``full_tensor()`` per gradient took one each, and the same norm from run to run (FSDP1's own
    ``clip_grad_norm_`` iterates a set of parameters: its last digits vary)."""
    params = [p for p in model.parameters() if p.grad is not None]
    fsdp1 = is_fsdp1(model)
    if not fsdp1 and not any(dtensors.is_dtensor(p) or dtensors.is_dtensor(p.grad) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    total = float(squared_norm(model).sqrt())  # the one read-back of the step's clipping
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        with torch.no_grad():  # on the local tensors (a DTensor's to_local is a view of its shard): one kernel
            torch._foreach_mul_([dtensors.local_tensor(p.grad) for p in params], coef)
    return total


def squared_norm(model: torch.nn.Module) -> torch.Tensor:
    """The squared 2-norm of all of a sharded model's gradients (float64, a 0-dim tensor on every rank).

    Every parameter names the process groups its gradient is sharded over: none for a whole tensor, the
    world for FSDP1's flat shards, for a DTensor the groups of the mesh dimensions that divide it
    (``Shard`` and ``_StridedShard``: :func:`moeflow.parallel.dtensors.split_mesh_dims`; a ``Replicate``
    dimension holds copies, counted once). Per such key, in parameter order, the squares of
    the local float32 norms are summed on this rank (a cumulative sum: the digits of a sequential loop),
    then all-reduced once per group. The keys come from every parameter, with a gradient here or not, so
    that every rank runs the same collectives in the same order; a key with no local gradient adds a zero
    built on the device its group's collectives take (:func:`collective_device`)."""
    fsdp1 = is_fsdp1(model)
    keys: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        grad = None if p.grad is None else p.grad.detach()
        if dtensors.is_dtensor(grad) and any(placement.is_partial() for placement in grad.placements):
            grad = grad.full_tensor()  # a pending sum (not what FSDP leaves): made whole, counted once
        like = grad if dtensors.is_dtensor(grad) else p
        if dtensors.is_dtensor(like):
            mesh = like.device_mesh
            key = tuple(mesh.get_group(dim) for dim in dtensors.split_mesh_dims(like))
        else:
            key = (None,) if fsdp1 else ()  # None: the default group
        local = keys.setdefault(key, [])
        if grad is not None:
            local.append(dtensors.local_tensor(grad))
    total = None
    for key, grads in keys.items():
        if grads:
            norms = _float32_norms(grads)
            # sequential on the CPU (the digits of a loop), a fixed scan on CUDA, where .sum() adds pairwise
            squares = torch.cumsum(torch.stack(norms).double() ** 2, 0)[-1]
        else:
            squares = torch.zeros((), dtype=torch.float64, device=collective_device(key[0] if key else None))
        for group in key:
            all_reduce_sum(squares, group)
        total = squares if total is None else total + squares.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def _float32_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each (local) gradient's 2-norm in float32, on its device: one foreach kernel for float32 gradients
    (torch 2.3's takes no dtype), else one norm at a time."""
    if any(g.dtype != torch.float32 for g in grads):
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return list(torch._foreach_norm(grads))


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by its name in the unwrapped model (a gather: tests, debugging)."""
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, with_grads=True, writeback=False):
            return {clean_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[clean_name(name)] = (
                p.grad.full_tensor().detach().clone() if dtensors.is_dtensor(p.grad) else p.grad.detach().clone()
            )
    return out
