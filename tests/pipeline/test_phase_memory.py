"""Measured peak RSS per phase and rank against the memory planner, on the benchmark model (issues #16, #38).

benchmarks/scale_worker.py runs the phases that move the whole training state (load, a step, checkpoint,
resume, export) under torchrun at 1, 2 and 4 gloo ranks with ``parallel.strategy: fsdp`` (FSDP1 on the
pinned stack, FSDP2 on the current one) on its 238M-parameter qwen3_moe (fp32, AdamW, 2 x 64 tokens a rank),
measuring each phase's peak RSS on every rank (the kernel's high-water mark, reset before the phase, less the
file-backed pages at its end: shared libraries' code, as large as their page cache makes them). For
every phase and rank the measurement is within 15% of ``phase_memory``'s per-rank figure for that job
(``rank_bytes``: with ``hardware.device: cpu`` a rank's resident set). The model folder is saved once
for the module; each run's checkpoint and export are deleted once read. Slow (a few minutes on 2 cores):
issue #16 asks for this model at these world sizes, and at 4 ranks a rank's state (227 MiB of weights) must
still stand out of the planned runtime (335-360 MiB). The five phases share one torchrun launch per world size,
and AdamW's moments come from a step on zero gradients rather than a training step before the measured one
(issue #23: a rank's unmeasured first step cost as much CPU as the measured one, 18 of its 67 CPU seconds at 2
ranks on pinned); the rest of the cost is the measured work, reported per rank and phase in ``cpu_seconds``.

On the current stack LoRA (rank 16 on every target, bf16, no gradient checkpointing: peft's fold of the fused
experts' adapters held for every layer, the planner's ``folded_experts``) and QLoRA (NF4, checkpointing) run at one
rank too (``RUNS``, ``--method`` of the worker): their frozen base in bf16 or 4 bits, the adapters' state in fp32.

The 4-rank runs are the pinned stack's only (FSDP1; the current stack's FSDP2 is measured at 1 and 2 ranks): they
are the slowest part of the suite on 2 cores, and .ci/run runs both stacks' suites side by side on one machine
(24 GiB here), where one stack's 4-rank run peaks at about 9 GiB over its ranks (1, 2 ranks: 4.4, 6 GiB), so two of
them at once plus the rest of both suites could exhaust memory; any other pair fits. The cores need not be
exclusive: a peak RSS is set by what is allocated, not by how fast (gloo's CPU collectives are synchronous; runs
of the same tree at different loads of the machine gave every phase's peak within 5 MiB).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import active_stack

from moeflow.plan.counts import count_parameters
from moeflow.plan.memory import Job, phase_memory, rank_bytes
from moeflow.settings import typed
from moeflow.train.settings import LoraSettings

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.scale, benchmarks.scale_worker

from benchmarks import scale_worker as W  # noqa: E402
from benchmarks.scale import PHASES, WORKER, run_worker  # noqa: E402

WORLDS = (1, 2, 4) if active_stack() == "pinned" else (1, 2)  # module docstring
# (method, ranks): the full fine-tune at every world size; LoRA and QLoRA in bf16 at one rank, on the stack whose
# experts are fused (peft's fold of their adapters) and that quantizes
RUNS = [("full", world) for world in WORLDS] + ([("lora", 1), ("qlora", 1)] if active_stack() == "current" else [])
TOLERANCE = 0.15  # measured / planned within 1 +- this (issue #38; #16 asked for 0.30)
BF16_RESUME_TOLERANCE = 0.25  # the worker's resume after a bf16 step (allowed)
EXPORT_SHARD_SIZE = "50MB"  # several files; the 131 MB embedding and output layer get one each
RUN_TIMEOUT_S = 1200
MIB = 2**20


@functools.cache  # both tests read it at every world size (the meta-device count is kept by moeflow.plan.counts)
def planned_phases(world: int, method: str = "full") -> dict:
    """``phase_memory`` for the worker's job (``--method``) at ``world`` fsdp ranks of one node (Job's docstring)."""
    shape, params, _ = count_parameters(W.model_section(), W.VOCAB)
    section = W.model_section()
    train, model, precision = W.METHODS[method]
    job = Job(
        precision=precision,
        method=train.get("method", "full"),
        micro_batch_size=W.MICRO_BATCH,
        seq_len=W.SEQ_LEN,
        gradient_checkpointing={**W.TRAIN, **train}["gradient_checkpointing"],
        attn_implementation=section["attn_implementation"],
        device="cpu",
        num_devices=world,
        expert_parallel=False,
        lora=typed(LoraSettings, train.get("lora", {})),
        quantization=model.get("quantization", "none"),
        loss_chunk_tokens=section["loss_chunk_tokens"],
        ranks_per_node=world,
    )
    return phase_memory(shape, params, job)


@pytest.fixture(scope="module")
def benchmark_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scale-model") / "model"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(WORKER), "build", str(folder)], check=True, env=env, timeout=600)
    return folder


@pytest.fixture(scope="module")
def measured(benchmark_model, tmp_path_factory) -> dict[tuple[str, int], dict]:
    """The worker's report per (method, world size) of ``RUNS`` (fsdp), this tree's design."""
    reports = {}
    for method, world in RUNS:
        out = tmp_path_factory.mktemp(f"scale-{method}-{world}")
        report = run_worker(
            sys.executable, REPO / "src", benchmark_model, out, world, "fsdp", EXPORT_SHARD_SIZE, RUN_TIMEOUT_S, method
        )
        shutil.rmtree(out)
        assert "error" not in report, f"the worker failed ({method}, {world} ranks):\n{report['error']}"
        reports[method, world] = report
    return reports


def ratio_table(measured: dict[tuple[str, int], dict]) -> tuple[list[str], list[tuple[str, int, str, int, float]]]:
    """Markdown lines of measured / planned per method, world, phase and rank (with the plan's terms and the phase's
    CPU seconds), and the ratios."""
    lines = [
        "| method | ranks | phase | rank | measured MiB | planned MiB | ratio | planned terms (MiB) | CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for (method, world), report in measured.items():
        planned = planned_phases(world, method)
        for phase in PHASES:
            want = rank_bytes(planned[phase])
            terms = {k: v for side in ("device", "host") for k, v in planned[phase][side].items() if k != "total"}
            shown = ", ".join(f"{k} {v / MIB:,.0f}" for k, v in terms.items() if v)
            for rank, numbers in enumerate(report["ranks"]):
                got, start = numbers[phase]["peak_rss_bytes"], numbers[phase]["start_rss_bytes"]
                ratios.append((method, world, phase, rank, got / want))
                lines.append(
                    f"| {method} | {world} | {phase} | {rank} | {got / MIB:,.0f} (start {start / MIB:,.0f})"
                    f" | {want / MIB:,.0f} | {got / want:.2f} | {shown} | {numbers[phase]['cpu_seconds']:.1f} |"
                )
    return lines, ratios


def allowed(method: str, phase: str) -> float:
    """The tolerance of a phase: ``TOLERANCE``, but for the resume of the bf16 methods ``BF16_RESUME_TOLERANCE``. The
    worker resumes in the process that took a bf16 step, which keeps about 100 MiB a fresh process has not allocated
    (oneDNN's bf16 primitives and their scratch: 1.15x at one rank); train_model resumes first, in a fresh process,
    and the pipeline tests hold a LoRA and a QLoRA run's resume to ``TOLERANCE`` (conftest.phases_against_plan)."""
    return BF16_RESUME_TOLERANCE if method != "full" and phase == "resume" else TOLERANCE


def test_measured_peak_rss_per_phase_and_rank_is_within_15_percent_of_the_plan(measured):
    lines, ratios = ratio_table(measured)
    print("\n".join(lines))  # shown with pytest -s
    off = [(m, w, p, r, round(x, 2)) for m, w, p, r, x in ratios if abs(x - 1) > allowed(m, p)]
    assert not off, (
        f"measured / planned peak RSS outside 1 +- {TOLERANCE} (method, ranks, phase, rank, ratio):\n"
        + "\n".join([repr(off), *lines])
    )


def test_between_steps_a_rank_holds_the_planned_resident_state(measured):
    """What a rank holds when a checkpoint starts (right after a step) is the plan's resident state, weights and
    AdamW's moments, within 20%: no gradient is left behind by the step (FSDP1 keeps each unit's flat gradient
    until the next forward unless the Trainer frees it: +1 local copy of the weights, 1.23-1.27x here)."""
    off = []
    for (method, world), report in measured.items():
        want = rank_bytes(planned_phases(world, method)["checkpoint"])
        for rank, numbers in enumerate(report["ranks"]):
            ratio = numbers["checkpoint"]["start_rss_bytes"] / want
            if ratio > 1.2:
                off.append((method, world, rank, round(ratio, 2)))
    assert not off, f"RSS at a checkpoint's start over the planned resident state (method, ranks, rank, ratio): {off}"
