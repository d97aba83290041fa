"""DTensors, the sharded tensors of FSDP2 and of expert parallelism: which tensors are, and a rank's part of them.

transformers 5's expert parallelism shards the experts as DTensors too; FSDP1 (the pinned stack) has none.
"""

from __future__ import annotations

from typing import Any


def dtensor_class() -> type:
    """torch's DTensor class; it lives in ``torch.distributed._tensor`` on torch 2.3."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.3
        from torch.distributed._tensor import DTensor
    return DTensor


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (FSDP2's and transformers 5's sharded parameters and gradients)."""
    return isinstance(value, dtensor_class())


def local_tensor(tensor: Any) -> Any:
    """This rank's part of a tensor: a DTensor's local tensor (a view of its shard, so in-place edits reach the
    DTensor), any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def split_mesh_dims(tensor: Any) -> list[int]:
    """The mesh dimensions over which a DTensor's elements are divided, not copied: every placement but
    ``Replicate`` and a pending sum (``Partial``). That is ``Shard`` and ``_StridedShard`` (FSDP2's placement of
    experts that expert parallelism already split, ``(_StridedShard(0, sf=ep), Shard(0))``), whose ``is_shard()``
    is False on torch 2.13: counting shards by ``is_shard()`` missed the FSDP dimension of those experts."""
    return [dim for dim, p in enumerate(tensor.placements) if not (p.is_replicate() or p.is_partial())]
