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
