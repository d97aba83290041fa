"""Training throughput: moeflow's loop vs the HF Trainer with the recipe people copy, and vs a tuned Trainer.

Same base model, same fine-tuning corpus, same optimizer and shape (micro-batch 2, accumulation 8,
AdamW, lr 6e-5, clipping 1.0), balancing loss off in every setup (HF's aux loss needs
output_router_logits, left off; moeflow ``balance.mode: off``), fp32, the same threads:

- ``recipe``: one document per example, truncated and padded to max_length 2048 (pad_to_multiple_of
  64), eager attention, gradient checkpointing, the HF Trainer;
- ``tuned``: the HF Trainer on moeflow's packed rows (sdpa, seq_len tokens per row, per-document
  attention from moeflow.collate), no checkpointing;
- ``moeflow``: moeflow.train.Trainer on the same packed rows.

Each (setup, round) runs in a fresh process (so peak RSS is its own), rounds alternate the order, and
the first optimizer step of every run is not timed. Reported per setup (medians over rounds): useful
tokens/s (non-padding tokens the model trains on), peak RSS, the fraction of the corpus's tokens the
setup trains on at all (truncation drops the rest), achieved FLOP/s (6 x active parameters x tokens)
against a measured fp32 matmul peak, and the ratios moeflow / recipe and moeflow / tuned.

    PYTHONPATH=src python benchmarks/train.py --model results/pinned/base/b-... --data results/pinned/data/d-.../target

Writes results/bench/train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO / "src"))

SETUPS = ("recipe", "tuned", "moeflow")
MICRO, ACCUM, LR, RECIPE_MAX_LENGTH = 2, 8, 6e-5, 2048


def documents(data_dir):
    from moeflow.tokenize import open_split, read_documents

    return [ids for _, ids in read_documents(open_split(data_dir, "train"))]


def packed_rows(data_dir):
    from moeflow.tokenize import open_split

    split = open_split(data_dir, "train")
    return [split[i] for i in range(len(split))]


def recipe_examples(docs, pad_id):
    """One document per example, truncated and padded to max_length (a multiple of 64 already)."""
    out = []
    for ids in docs:
        ids = ids[:RECIPE_MAX_LENGTH]
        pad = RECIPE_MAX_LENGTH - len(ids)
        out.append({
            "input_ids": ids + [pad_id] * pad,
            "attention_mask": [1] * len(ids) + [0] * pad,
            "labels": ids + [-100] * pad,
        })
    return out


def matmul_peak(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * 2048**3 / (time.perf_counter() - started))
    return best


def worker(setup: str, args) -> dict:
    import torch

    from moeflow.modeling import load_model, load_tokenizer
    from moeflow.stage import set_offline
    from moeflow.train import Trainer, TrainSettings, active_parameters, collate_rows

    set_offline()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    attn = "eager" if setup == "recipe" else "sdpa"
    model = load_model(args.model, {"attn_implementation": attn})
    tokenizer = load_tokenizer(args.model)
    steps = args.steps + 1  # the first step is not timed
    step_times: list[float] = []

    if setup == "moeflow":
        rows = packed_rows(args.data)
        settings = TrainSettings.from_config({"steps": steps, "lr": LR, "warmup_steps": 1, "micro_batch_size": MICRO, "grad_accum_steps": ACCUM,
                                              "balance": {"mode": args.balance}, "memory_guard": {"skip_steps": 10**6}})
        trainer = Trainer(model, settings, rows, collate_fn=lambda r: collate_rows(r, attn), seed=0)
        trainer.run()
        step_times = [r["seconds"] for r in trainer.train_records()[1:]]
        examples = rows
    else:
        from transformers import Trainer as HFTrainer
        from transformers import TrainerCallback, TrainingArguments

        class Timer(TrainerCallback):
            def on_step_begin(self, a, state, control, **kw):
                self.started = time.perf_counter()

            def on_step_end(self, a, state, control, **kw):
                step_times.append(time.perf_counter() - self.started)

        if setup == "recipe":
            examples = recipe_examples(documents(args.data), tokenizer.pad_token_id or 0)

            def collate(batch):
                return {k: torch.tensor([b[k] for b in batch]) for k in ("input_ids", "attention_mask", "labels")}
        else:
            examples = packed_rows(args.data)

            def collate(batch):
                out = collate_rows(batch, attn)
                out.pop("doc_ids")
                return out

        with tempfile.TemporaryDirectory() as tmp:
            hf_args = TrainingArguments(
                output_dir=tmp, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, learning_rate=LR,
                max_grad_norm=1.0, weight_decay=0.1, adam_beta2=0.95, max_steps=steps, lr_scheduler_type="cosine", warmup_steps=1,
                gradient_checkpointing=setup == "recipe", gradient_checkpointing_kwargs={"use_reentrant": False} if setup == "recipe" else None,
                report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
                use_cpu=True, seed=0, remove_unused_columns=False, optim="adamw_torch",
            )
            trainer = HFTrainer(model=model, args=hf_args, train_dataset=examples, data_collator=collate, callbacks=[Timer()])
            trainer.train()
        step_times = step_times[1:]

    # Useful tokens: the non-padding labels a step trains on, in expectation over the corpus (the recipe's
    # step costs the same whatever its documents' lengths: everything is padded to max_length).
    per_example = sum(sum(1 for t in e["labels"][1:] if t != -100) for e in examples) / len(examples)
    seconds = sum(step_times)
    tokens = per_example * MICRO * ACCUM * len(step_times)
    return {
        "setup": setup,
        "useful_tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / len(step_times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "flops_per_s": 6 * active_parameters(model) * tokens / seconds,
    }


def corpus_fractions(data_dir) -> dict:
    docs = documents(data_dir)
    total = sum(len(d) for d in docs)
    return {
        "recipe_max_length_2048": sum(min(len(d), RECIPE_MAX_LENGTH) for d in docs) / total,
        "recipe_max_length_512": sum(min(len(d), 512) for d in docs) / total,
        "tuned": 1.0,
        "moeflow": 1.0,
        "documents": len(docs),
        "tokens": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the base model folder (pretrain_base's output or a pretrained model)")
    parser.add_argument("--data", required=True, help="the fine-tuning corpus folder (the tokenize stage's output)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run (after one untimed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--balance", default="off", help="moeflow's balance mode (off: like for like with the Trainers)")
    parser.add_argument("--worker", choices=SETUPS)
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "train.json"))
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return

    runs = {s: [] for s in SETUPS}
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(args.threads)}
    for round_ in range(args.rounds):
        order = SETUPS[round_ % 3:] + SETUPS[: round_ % 3]
        for setup in order:
            command = [sys.executable, __file__, "--worker", setup, "--model", args.model, "--data", args.data,
                       "--steps", str(args.steps), "--threads", str(args.threads), "--balance", args.balance]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{setup} failed:\n{done.stderr[-4000:]}")
            result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
            runs[setup].append(result)
            print(f"round {round_ + 1} {setup}: {result['useful_tokens_per_s']:.0f} useful tok/s, {result['peak_rss_mib']:.0f} MiB", flush=True)

    peak = matmul_peak(args.threads)
    summary = {}
    for setup, results in runs.items():
        summary[setup] = {key: statistics.median(r[key] for r in results) for key in ("useful_tokens_per_s", "seconds_per_step", "peak_rss_mib", "flops_per_s")}
        summary[setup]["fraction_of_matmul_peak"] = summary[setup]["flops_per_s"] / peak
    ratios = {
        f"moeflow_over_{other}": statistics.median(m["useful_tokens_per_s"] / o["useful_tokens_per_s"] for m, o in zip(runs["moeflow"], runs[other]))
        for other in ("recipe", "tuned")
    }
    import torch

    from moeflow import compat

    report = {
        "setups": summary,
        "ratios_useful_tokens_per_s": ratios,
        "corpus_fraction_trained": corpus_fractions(args.data),
        "matmul_peak_flops_per_s_fp32": peak,
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "shape": {"micro_batch_size": MICRO, "grad_accum_steps": ACCUM, "recipe_max_length": RECIPE_MAX_LENGTH},
        "moeflow_balance_mode": args.balance,
        "threads": args.threads,
        "stack": {"torch": torch.__version__, "transformers": str(compat.version_of("transformers"))},
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"setups": summary, "ratios": ratios, "corpus_fraction_trained": report["corpus_fraction_trained"]}, indent=1))


if __name__ == "__main__":
    main()
