"""The device and dtype a stage computes in, from the config keys ``hardware.device`` and ``precision``."""

from __future__ import annotations

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class DeviceUnavailable(RuntimeError):
    """The config asks for a device this machine does not have."""


def compute_device(hardware_device: str) -> torch.device:
    """The device ``hardware.device`` names; a CUDA config on a machine without a visible GPU is refused
    (never a silent fall-back to the CPU: the stage's results and timings would be the CPU's)."""
    if hardware_device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            "config key 'hardware.device' is 'cuda' but torch sees no CUDA device here "
            "(torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES and the node's GPUs), "
            "or set hardware.device: cpu"
        )
    if hardware_device == "cuda":
        enable_tf32()
    return torch.device(hardware_device)


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (~989 vs ~67 TFLOP/s on an H100; 10-bit mantissa
    products, fp32 accumulation): every CUDA stage gets its device from :func:`compute_device`."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the model's weights are loaded in for a forward-only stage with ``precision``."""
    return COMPUTE_DTYPES[precision]


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
