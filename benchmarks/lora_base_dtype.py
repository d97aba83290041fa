"""Benchmark: LoRA's frozen base held in fp32, in bf16 (``precision: bf16``) and in NF4 (QLoRA), on one process.

    python benchmarks/lora_base_dtype.py              # a ~277M-parameter qwen3_moe, LoRA rank 16 on every target
    python benchmarks/lora_base_dtype.py --steps 4    # more steps
    python benchmarks/lora_base_dtype.py --shape qwen3-30b-a3b-router --bases bf16,nf4   # the real-shape slice

A qwen3_moe model is built from its config and saved once, in bf16 as published models are; each base (fp32; bf16;
NF4 with bf16 compute, ``model.quantization: nf4``: bitsandbytes, the current stack) runs in a fresh process
through moeflow's own path (moeflow.loading.factory.make_model with a LoRA layout, then the Trainer): its resident
set before the load (imports done), its high-water mark after the load and after the steps (``VmHWM``), the bytes of
its parameters, the planner's figure for them (moeflow.plan.memory.held_weight_bytes),
tokens per second over the steps after the first, and the last step's loss (the same rows and adapters' start in
every run). Writes results/bench/lora_base_dtype.json (``--shape``: lora_base_dtype-<shape>.json) with the ratios
bf16 / fp32 and NF4 / bf16 of the bases run.

``--shape`` takes benchmarks/real_shape.py's slice of a published model instead (its router and vocabulary on a
small decoder, one micro-batch of its sequence length a step, its synthetic packed rows), where the output layer
and the loss over a 151,936-entry vocabulary weigh as they do at full size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
VOCAB = 32000
SEQ_LEN = 256
# the ~277M-parameter qwen3_moe of the load benchmark, and its reading of /proc/self/status
from load_memory import qwen3_moe_config, status_mib  # noqa: E402

LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": ["all"], "router": "frozen"}


def _model_section(experts: int) -> dict:
    return {"config": qwen3_moe_config(experts), "experts_implementation": None, "attn_implementation": "sdpa"}


def _workload(experts: int, shape: str | None) -> tuple[dict, int, int]:
    """The model section, its vocabulary and the sequence length: the ~277M qwen3_moe, or a real-shape slice."""
    if shape is None:
        return _model_section(experts), VOCAB, SEQ_LEN
    from real_shape import SHAPES, model_section

    real = SHAPES[shape]
    return model_section(real, real.vocab_size), real.vocab_size, real.seq_len


def _rows(steps: int, shape: str | None) -> list[dict]:
    if shape is None:
        from synthetic_rows import two_document_rows

        return two_document_rows(steps, SEQ_LEN, VOCAB)
    from real_shape import SHAPES, synthetic_rows

    real = SHAPES[shape]
    return synthetic_rows(real, real.vocab_size, steps)


def save(folder: Path, experts: int, shape: str | None) -> None:
    import torch

    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    section, vocab, _ = _workload(experts, shape)
    model = make_model(typed(ModelSettings, section), vocab_size=vocab, seed=0)
    model.to(torch.bfloat16).save_pretrained(folder)  # in bf16, as published models are


# base: (precision, model.quantization)
BASES = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "nf4": ("bf16", "nf4")}


def run(folder: str, base_name: str, experts: int, steps: int, threads: int, shape: str | None) -> None:
    """One base in this process; prints its figures as JSON."""
    import torch

    torch.set_num_threads(threads)
    from moeflow.data.collate import collate
    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.plan.counts import count_parameters
    from moeflow.plan.memory import Job, PlanMemoryStage, held_weight_bytes
    from moeflow.settings import typed
    from moeflow.train.settings import TrainSettings
    from moeflow.train.trainer import Trainer
    from moeflow.workflow.keys import plan_settings, training
    from moeflow.workflow.load import load

    precision, quantization = BASES[base_name]
    section = {"method": "lora", "lora": LORA, "steps": steps, "warmup_steps": 1, "micro_batch_size": 1}
    section |= {"grad_accum_steps": 1, "lr": 1e-3, "min_lr": 1e-4, "gradient_checkpointing": True}
    train = typed(TrainSettings, training(section))
    single = Layout.single("cpu", train)
    layout = Layout(single.ranks, single.parallel, train, precision)
    section_of_model, vocab, seq_len = _workload(experts, shape)
    base = status_mib("VmRSS")
    settings = {"config": {}, "experts_implementation": section_of_model["experts_implementation"]}
    settings["quantization"] = quantization
    model = make_model(typed(ModelSettings, settings), folder=folder, layout=layout)
    loaded = status_mib("VmHWM")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = _rows(steps, shape)
    started = None

    def clock(step: int, _model) -> None:
        nonlocal started
        if step == 1:  # after the first step: its allocations and lazy set-up are not the steady rate
            started = time.perf_counter()

    trainer = Trainer(model, train, rows, collate_fn=collate, seed=0, precision=precision, step_hook=clock)
    trainer.run()
    seconds = time.perf_counter() - started
    peak = status_mib("VmHWM")
    planned = plan_settings(load(overrides={"train": section, "precision": precision}))
    planned["model"] = planned["model"] | section_of_model | {"quantization": quantization}
    planned = typed(PlanMemoryStage, planned)
    model_shape, params, _ = count_parameters(planned.model, vocab)
    record = {
        "base": base_name,
        "precision": precision,
        "base_mib": round(base, 1),
        "after_load_mib": round(loaded, 1),
        "peak_mib": round(peak, 1),
        "parameters_mib": round(held / 2**20, 1),
        "planned_parameters_mib": round(held_weight_bytes(model_shape, params, Job.from_settings(planned)) / 2**20, 1),
        "tokens_per_s": round((steps - 1) * seq_len / seconds, 1),
        "last_loss": round(trainer.train_records()[-1]["loss"], 4),
    }
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default=None, help="a benchmarks/real_shape.py slice instead of the ~277M model")
    parser.add_argument("--bases", default=",".join(BASES), help="comma-separated, of " + ", ".join(BASES))
    parser.add_argument("--out", default=None, help="default: results/bench/lora_base_dtype[-<shape>].json")
    args = parser.parse_args()
    out = args.out or str(REPO / "results" / "bench" / f"lora_base_dtype{'-' + args.shape if args.shape else ''}.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "base"
        save(folder, args.experts, args.shape)
        for base_name in args.bases.split(","):
            cmd = [sys.executable, __file__, "--run", str(folder), base_name, str(args.experts), str(args.steps)]
            cmd += [str(args.threads), args.shape or ""]
            env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(args.threads)}
            stdout = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            rows += [json.loads(line) for line in stdout.stdout.splitlines() if line.startswith("{")]
    by_base = {row["base"]: row for row in rows}
    pairs = {"bf16_over_fp32": ("bf16", "fp32"), "nf4_over_bf16": ("nf4", "bf16")}
    ratios = {
        name: ratio(by_base[new], by_base[old]) for name, (new, old) in pairs.items() if {new, old} <= set(by_base)
    }
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(ratios))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"rows": rows, **ratios}, indent=2) + "\n")


def ratio(new: dict, old: dict) -> dict:
    return {
        "parameters": round(new["parameters_mib"] / old["parameters_mib"], 3),
        "peak_above_base": round((new["peak_mib"] - new["base_mib"]) / (old["peak_mib"] - old["base_mib"]), 3),
        "tokens_per_s": round(new["tokens_per_s"] / old["tokens_per_s"], 3),
        "last_loss": round(new["last_loss"] - old["last_loss"], 4),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        folder, base_name, experts, steps, threads, shape = sys.argv[2:8]
        run(folder, base_name, int(experts), int(steps), int(threads), shape or None)
    else:
        main()
