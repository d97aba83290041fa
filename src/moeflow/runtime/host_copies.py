"""Host-to-device copies of batches: through pinned memory to a GPU, so the copy does not block the host.

Plumbing: a copy gives the same values whichever way it goes (moeflow.workflow.rule_code's ``PLUMBING``).
"""

from __future__ import annotations

import torch


def copies_through_pinned_memory(source: torch.Tensor, device: torch.device | str) -> bool:
    """Whether :func:`to_device` stages ``source`` in pinned (page-locked) memory and copies it without blocking:
    a CPU tensor going to a CUDA device. A copy from pageable memory blocks the host until the GPU has it, after
    the forward was queued; from pinned memory it is one asynchronous DMA."""
    return source.device.type == "cpu" and torch.device(device).type == "cuda"


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes to a GPU through pinned memory with ``non_blocking`` (the
    caching host allocator keeps the pinned buffer until the copy is done). Every host-to-device copy of a
    batch (inputs, labels, positions) goes through here."""
    if copies_through_pinned_memory(tensor, device):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
