"""A tiny qwen3_moe Trainer on synthetic packed rows (the data stage's row format): what the training,
fault and security tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny_models import tiny_model_cfg

from moeflow.data.collate import collate
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime.stage import KILL_ENV
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

VOCAB = 97
SEQ = 32


def packed_rows(n=24, seed=0):
    """Rows in the data stage's format: several documents per row, positions restart, -100 at starts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(n):
        cut = int(torch.randint(5, SEQ - 5, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
        labels = list(ids)
        labels[0] = labels[cut] = -100
        rows.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": list(range(cut)) + list(range(SEQ - cut)),
                "doc_ids": [2 * r] * cut + [2 * r + 1] * (SEQ - cut),
            }
        )
    return rows


def settings(**overrides):
    base = {
        "steps": 6,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 2,
        "micro_batch_size": 2,
        "grad_accum_steps": 2,
        "balance": {"mode": "running", "coef": 0.01, "z_loss_coef": 0.001},
        "routing_guard": {"window_steps": 2, "max_load_ratio": 3.9, "min_load_entropy": 0.1, "max_dead_experts": 4},
        "memory_guard": {"skip_steps": 100},
    }
    return typed(TrainSettings, training({**base, **overrides}))


def make_trainer(tmp=None, seed=0, **kwargs):
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=seed)
    s = kwargs.pop("train_settings", None) or settings()
    return Trainer(model, s, packed_rows(), collate_fn=collate, seed=seed, **kwargs)


def losses(trainer):
    return [(r["step"], r["loss"], r["ce"], r["grad_norm"]) for r in trainer.train_records()]


def run_training_script(
    script: str | os.PathLike, folder: Path, steps: int, kill_at: str | None = None
) -> subprocess.CompletedProcess:
    """Run a test file as a training script (``script folder steps``) in a fresh interpreter, SIGKILLed at the
    kill point ``kill_at`` if given (moeflow.runtime.stage.kill_point)."""
    env = dict(os.environ)
    env.pop(KILL_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")])
    if kill_at:
        env[KILL_ENV] = kill_at
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(steps)], env=env, capture_output=True, text=True, timeout=300
    )
