"""Benchmark: LoRA (or QLoRA) on 2 FSDP ranks against one process, on the same global batch.

    python benchmarks/lora_ranks.py                      # LoRA, bf16, the ~277M-parameter qwen3_moe
    python benchmarks/lora_ranks.py --quantization nf4   # QLoRA

The model of benchmarks/lora_base_dtype.py (saved once in bf16) trains LoRA rank 16 on every target through
moeflow's own path (make_model with a LoRA layout, then the Trainer), with activation checkpointing: once in one
process with 2 threads and 2 micro-batches a step, once on 2 gloo ranks under ``parallel.strategy: fsdp`` (FSDP2)
with a thread and a micro-batch each. Per run: each rank's resident set before the load and its high-water mark
after the steps, tokens per second over the steps after the first (the global batch's), and the losses (equal to
float precision: the ranks compute one process's sums). On this machine's 2 cores the ranks share the cores one
process had, so tokens/s compares the layouts' overheads, not their scaling. Writes results/bench/lora_ranks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from load_memory import status_mib  # noqa: E402
from lora_base_dtype import LORA, SEQ_LEN, VOCAB, save  # noqa: E402

MICRO_BATCHES = 2  # per step, over the ranks


def run(folder: str, quantization: str, steps: int) -> None:
    """This rank's (or process's) run; rank 0 prints the figures of every rank as JSON."""
    import torch
    from synthetic_rows import two_document_rows

    from moeflow.data.collate import collate
    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.parallel.process_group import check_ranks, gather_objects, init
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.settings import typed
    from moeflow.train.settings import TrainSettings
    from moeflow.train.trainer import Trainer
    from moeflow.workflow.keys import training

    ranks = init("cpu")
    torch.set_num_threads(max(1, 2 // ranks.world_size))
    strategy = "fsdp" if ranks.world_size > 1 else "none"
    parallel = check_ranks(typed(ParallelSettings, {"strategy": strategy, "nproc_per_node": ranks.world_size}), ranks)
    section = {"method": "lora", "lora": LORA, "steps": steps, "warmup_steps": 1, "micro_batch_size": 1}
    section |= {"grad_accum_steps": MICRO_BATCHES // ranks.world_size, "lr": 1e-3, "min_lr": 1e-4}
    section |= {"gradient_checkpointing": True, "balance": {"mode": "exact"}}
    train = typed(TrainSettings, training(section))
    base = status_mib("VmRSS")
    settings = {"config": {}, "experts_implementation": None, "quantization": quantization}
    model = make_model(typed(ModelSettings, settings), folder=folder, layout=Layout(ranks, parallel, train, "bf16"))
    started = None

    def clock(step: int, _model) -> None:
        nonlocal started
        if step == 1:
            started = time.perf_counter()

    rows = two_document_rows(steps * MICRO_BATCHES, SEQ_LEN, VOCAB)
    trainer = Trainer(model, train, rows, collate_fn=collate, seed=0, precision="bf16", step_hook=clock)
    trainer.run()
    seconds = time.perf_counter() - started
    memory = gather_objects({"base_mib": round(base, 1), "peak_mib": round(status_mib("VmHWM"), 1)})
    if ranks.is_main:
        record = {
            "ranks": ranks.world_size,
            "strategy": strategy,
            "quantization": quantization,
            "per_rank": memory,
            "tokens_per_s": round((steps - 1) * MICRO_BATCHES * SEQ_LEN / seconds, 1),
            "losses": [round(r["loss"], 6) for r in trainer.train_records()],
        }
        print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quantization", default="none", choices=["none", "nf4", "fp4", "int8"])
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "lora_ranks.json"))
    args = parser.parse_args()
    rows = []
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "base"
        save(folder, args.experts)
        worker = [__file__, "--worker", str(folder), args.quantization, str(args.steps)]
        for launcher in (
            [sys.executable],
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        ):
            done = subprocess.run(launcher + worker, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"{shlex.join(launcher + worker)} failed:\n{done.stderr[-3000:]}")
            rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    one, two = rows
    ratios = {
        "tokens_per_s": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
        "peak_above_base_per_rank": round(
            max(r["peak_mib"] - r["base_mib"] for r in two["per_rank"])
            / (one["per_rank"][0]["peak_mib"] - one["per_rank"][0]["base_mib"]),
            3,
        ),
        "largest_loss_difference": max(abs(a - b) for a, b in zip(one["losses"], two["losses"])),
    }
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"two_ranks_over_one": ratios}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "two_ranks_over_one": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        folder, quantization, steps = sys.argv[2:5]
        run(folder, quantization, int(steps))
    else:
        main()
