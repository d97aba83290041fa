"""Each phase's peak memory on a CPU rank (moeflow.train.peak_memory): the resident set's high-water mark of the
phase itself, not of an earlier, larger one, and the largest over a phase's runs; and the trainer's steps log it."""

from __future__ import annotations

import torch
from tiny_models import model_config

from moeflow.data.collate import collate
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.settings import typed
from moeflow.train.peak_memory import PhasePeaks, by_phase
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

MIB = 2**20
CPU = torch.device("cpu")


def touch(mib: int) -> torch.Tensor:
    """``mib`` MiB resident (written, so its pages are really there)."""
    return torch.ones(mib * MIB // 4)


def test_a_phase_peak_is_its_own_and_a_repeated_phase_keeps_its_largest():
    peaks = PhasePeaks(CPU)
    with peaks.measure("large"):
        big = touch(256)
        del big
    large = peaks.last
    with peaks.measure("small"):
        small = touch(16)
        del small
    # the mark was reset: the small phase does not report the large one's 256 MiB
    assert large - peaks.last > 200 * MIB
    with peaks.measure("small"):
        pass
    assert peaks.bytes["large"] == large and peaks.bytes["small"] >= peaks.last
    assert by_phase([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}


def test_a_trainers_step_logs_its_peak_and_its_phases():
    model = make_model(typed(ModelSettings, model_config("qwen3_moe", "sdpa")), vocab_size=97, seed=0)
    ids = list(range(3, 35))
    rows = [{"input_ids": ids, "labels": [-100, *ids[1:]], "position_ids": list(range(32)), "doc_ids": [0] * 32}] * 4
    settings = typed(TrainSettings, training({"steps": 2, "micro_batch_size": 2, "lr": 1e-3}))
    trainer = Trainer(model, settings, rows, collate_fn=collate, seed=0)
    record = trainer.train_step()
    assert record["memory_mib"] * MIB == trainer.peaks.last == trainer.peaks.bytes["step"]
    assert set(trainer.peaks.bytes) == {"step"}
