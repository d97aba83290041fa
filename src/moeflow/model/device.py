"""The device and dtype a model computes in, from the config keys ``hardware.device`` and ``precision``.

On CUDA, fp32 matmuls run on TF32 tensor cores: a choice that changes the numbers, so it is made here, in code
every rule that computes declares (moeflow.workflow.rule_code), not in the job's plumbing.
"""

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
