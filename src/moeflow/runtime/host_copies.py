"""Host-to-device copies of batches: to the device a model computes on, through pinned memory to a GPU.

Plumbing: a copy gives the same values whichever way it goes, and the device a model computes on is
``hardware.device``'s (moeflow.workflow.rule_code's ``PLUMBING``).
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


_COMPUTE_DEVICE_ATTR = "_moeflow_compute_device"


def set_compute_device(model: torch.nn.Module, device: torch.device) -> None:
    """Record where ``model`` computes when its parameters live elsewhere (moeflow.parallel.layouts' CPU offload:
    the shards on the host, each layer copied to ``device`` while it runs), on it and on a peft model's base."""
    for module in {id(m): m for m in (model, _base(model))}.values():
        setattr(module, _COMPUTE_DEVICE_ATTR, torch.device(device))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device ``model`` computes on, where its inputs go: the one :func:`set_compute_device` recorded, else its
    parameters' (under CPU offload those are on the host)."""
    device = getattr(_base(model), _COMPUTE_DEVICE_ATTR, None)
    return device if device is not None else next(model.parameters()).device


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """A peft model's transformers model (what the trainer, the evaluation and the export are given, either)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
