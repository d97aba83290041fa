"""The CPU runtime the memory planner counts per training rank, measured on a finished pipeline.

A run's ``train/phase_peaks.json`` holds each phase's peak resident set on every rank (warmup's and train_model's,
moeflow.train.peak_memory), and its ``plan.json`` what the planner counted for it. On a model of a few MiB (the
smoke pipeline's) the measurement is nearly all runtime: the interpreter, torch, transformers, the data's libraries,
gloo, what the first step leaves allocated, and peft for a LoRA run. So a phase's measured peak less the plan's
terms other than ``runtime`` is the runtime that phase measured; moeflow.plan.memory's ``CPU_RANK_RUNTIME_BYTES``
(and ``CPU_ADAPTER_RUNTIME_BYTES`` for LoRA) come from here.

    snakemake train --cores 2 --configfile config/smoke.yaml          # per stack (STACK=pinned|current)
    python benchmarks/rank_runtime.py results/<stack>                 # every run under results/<stack>/runs

Prints, per run and phase, the measured peak (largest rank), the plan's model terms, the runtime they imply and the
plan's runtime, in MiB.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 2**20


def implied_runtimes(run: Path) -> list[tuple[str, float, float, float, float]]:
    """(phase, measured MiB, planned MiB without the runtime, implied runtime MiB, planned runtime MiB)."""
    plan = json.loads((run / "plan.json").read_text())
    measured = json.loads((run / "train" / "phase_peaks.json").read_text())
    rows = []
    for phase, planned in plan["phases"].items():
        peaks = [b for stage in measured["stages"].values() for b in stage.get(phase, [])]
        if not peaks:
            continue
        terms = {k: v for side in ("device_bytes", "host_bytes") for k, v in planned[side].items() if k != "total"}
        runtime = terms.pop("runtime")
        model = sum(terms.values())
        rows.append((phase, max(peaks) / MIB, model / MIB, (max(peaks) - model) / MIB, runtime / MIB))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a finished pipeline's results/<stack>")
    args = parser.parse_args()
    print("| run | method | phase | measured | model terms | implied runtime | planned runtime |")
    print("|---|---|---|---|---|---|---|")
    for run in sorted(p for p in (args.results / "runs").iterdir() if (p / "train" / "phase_peaks.json").exists()):
        method = json.loads((run / "plan.json").read_text())["job"]["method"]
        for phase, got, model, implied, planned in implied_runtimes(run):
            print(f"| {run.name} | {method} | {phase} | {got:.0f} | {model:.1f} | {implied:.0f} | {planned:.0f} |")


if __name__ == "__main__":
    main()
