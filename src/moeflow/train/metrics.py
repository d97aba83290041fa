"""What training measures and writes: metrics.jsonl, TensorBoard events, memory readings.

It also counts the FLOP-bearing parameters per token behind the FLOP rates."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.model import parameters as P
from moeflow.model.wrappers import unwrap
from moeflow.parallel.layouts import original_shape


class MetricsLog:
    """metrics.jsonl plus TensorBoard event files (scalars, and per-layer expert-load histograms)."""

    def __init__(self, log_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter  # heavy, and only rank 0 writes

        self.dir = Path(log_dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "w", encoding="utf-8")
        self.writer = SummaryWriter(str(self.dir / "tensorboard"))

    def write(self, record: Mapping[str, Any]) -> None:
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.jsonl.flush()
        step = int(record["step"])
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)
        for layer, health in enumerate(record.get("routing", [])):
            for key in ("max_over_mean", "cv", "load_entropy", "router_entropy"):
                if key in health:
                    self.writer.add_scalar(f"routing/layer{layer}/{key}", health[key], step)
            self.writer.add_scalar(f"routing/layer{layer}/dead_experts", len(health["dead_experts"]), step)
            load = health["load"]
            total = sum(load)
            if total:
                self.writer.add_histogram_raw(
                    f"routing/layer{layer}/expert_load",
                    min=0,
                    max=len(load) - 1,
                    num=total,
                    sum=sum(i * c for i, c in enumerate(load)),
                    sum_squares=sum(i * i * c for i, c in enumerate(load)),
                    bucket_limits=[i + 0.5 for i in range(len(load))],
                    bucket_counts=load,
                    global_step=step,
                )
        self.writer.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.writer.close()


def active_parameters(model: torch.nn.Module) -> int:
    """``moeflow.model.parameters.active_per_token`` of a model in any layout (whole parameters, also of a
    sharded model)."""
    sizes = {n: math.prod(original_shape(p)) for n, p in model.named_parameters()}
    return P.active_per_token(unwrap(model).config, sizes)


def flop_bearing_parameters(model: torch.nn.Module, mtp_trains: bool = False) -> int:
    """``moeflow.model.parameters.flop_bearing_per_token`` of a model in any layout: the MFU's count (the
    active parameters without the input embedding's lookup; a tied head counted once, as the head). The MTP
    layers count only when they train (``train.mtp.mode: train``): frozen, they are not run, and the planner
    counts without them."""
    skipped = () if mtp_trains else mtp_prefixes(model)
    sizes = {n: math.prod(original_shape(p)) for n, p in model.named_parameters() if not is_mtp_name(n, skipped)}
    return P.flop_bearing_per_token(unwrap(model).config, sizes)
