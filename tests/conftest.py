"""Shared fixtures. Unit tests import the package directly; only pipeline tests run Snakemake."""

from __future__ import annotations

import os

import pytest

from moeflow.stage import set_offline

set_offline()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield
