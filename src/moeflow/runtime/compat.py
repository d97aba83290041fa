"""What differs between the two supported stacks (torch 2.3 + transformers 4.57, and torch 2.6+ + transformers 5).

Every stack-dependent branch in the package asks these functions instead of parsing versions itself.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.version import Version


class UnsupportedOnStack(RuntimeError):
    """A feature was asked for that the installed stack does not provide."""


@functools.cache
def version_of(dist: str) -> Version | None:
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


def transformers_major() -> int:
    v = version_of("transformers")
    if v is None:
        raise UnsupportedOnStack("transformers is not installed")
    return v.major


def is_transformers_v5() -> bool:
    return transformers_major() >= 5


def require_transformers_v5(feature: str) -> None:
    """Raise a clear error where a feature exists on the current stack (transformers 5) only."""
    if not is_transformers_v5():
        raise UnsupportedOnStack(
            f"{feature} needs transformers 5 (the 'current' stack); this environment has "
            f"transformers {version_of('transformers')}. Run with STACK=current, or turn the setting off."
        )


def fsdp2_available() -> bool:
    """Whether moeflow shards with FSDP2 (``fully_shard``): torch >= 2.6 (the current stack). torch 2.3's early
    ``fully_shard`` needs CUDA, so the pinned stack uses FSDP1 on every device, one code path there. Read from
    the installed version, without importing torch: the memory planner asks at DAG build time."""
    return version_of("torch").release[:2] >= (2, 6)


def torch_has_muon() -> bool:
    """Whether torch ships ``torch.optim.Muon`` (torch >= 2.9: the current stack), read from the installed version
    without importing torch (config check)."""
    return version_of("torch").release[:2] >= (2, 9)


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (FSDP2's and transformers 5's sharded parameters and gradients); it lives
    in ``torch.distributed._tensor`` on torch 2.3."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.3
        from torch.distributed._tensor import DTensor
    return isinstance(value, DTensor)


def enable_activation_checkpointing(model: object, reentrant: bool = False) -> None:
    """Activation checkpointing of a transformers model: ``activation_checkpointing_enable`` on transformers 5
    (which renamed it; the old name warns there), ``gradient_checkpointing_enable`` on 4.57."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
