"""moeflow.model.device: the compute device, and TF32 on for CUDA stages."""

from __future__ import annotations

import pytest
import torch

from moeflow.model import device
from moeflow.parallel.process_group import init


@pytest.fixture
def tf32_off():
    """TF32 off for the test, restored after (torch's flags are process-wide; monkeypatch cannot set them)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_cuda_device_turns_tf32_on_and_the_cpu_leaves_it(monkeypatch, tf32_off):
    device.compute_device("cpu")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.compute_device("cuda") == torch.device("cuda")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_training_ranks_get_their_device_through_compute_device(monkeypatch, tf32_off):
    """init (every training stage) passes through device.compute_device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = init("cuda")
    assert ranks.device == torch.device("cuda", 0) and torch.backends.cuda.matmul.allow_tf32


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(device.DeviceUnavailable, match="hardware.device"):
        init("cuda")
