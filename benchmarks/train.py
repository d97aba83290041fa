"""Training throughput: moeflow's loop vs the HF Trainer with the recipe people copy, and vs a tuned Trainer.

Same base model, same fine-tuning corpus, same optimizer and shape (micro-batch 2, accumulation 8,
AdamW, lr 6e-5, clipping 1.0), balancing loss off in every compared setup (HF's aux loss needs
output_router_logits, left off; moeflow ``balance.mode: off``), fp32, the same threads:

- ``recipe``: one document per example, truncated and padded to max_length 2048 (pad_to_multiple_of
  64), eager attention, gradient checkpointing (non-reentrant), the HF Trainer;
- ``tuned``: the HF Trainer on moeflow's packed rows (sdpa, seq_len tokens per row, per-document
  attention from moeflow.data.collate, ``use_cache`` off as moeflow's loop has it), no checkpointing;
- ``moeflow``: moeflow.train.trainer.Trainer on the same packed rows;
- ``moeflow_bf16``: the same in bf16 autocast (the measurement behind the config's ``precision``);
- ``moeflow_running``, ``moeflow_exact``, ``moeflow_micro_batch`` (``--balance-modes``): moeflow with
  its global-batch balancing loss on (coef 0.01), reported separately (the Trainers have no such mode);
- ``moeflow_lora`` (``--lora-only``): moeflow training LoRA adapters (``train.method: lora`` with
  config/config.yaml's ``train.lora``) against moeflow's full fine-tune, stored as ``lora_vs_full``.

Each (setup, round) runs in a fresh process (so peak RSS is its own); each round rotates the order.
A run warms up with one micro-batch forward and backward (not timed), then trains ``--steps`` timed
optimizer steps (``--recipe-steps`` for the recipe, whose step holds 4x the tokens at quadratic
attention cost); seconds per step is the median of the step times, measured from the first step's
start and then between consecutive optimizer-step ends (everything a step costs: data loading,
collation, forward/backward, optimizer, the loop's own telemetry). CPU seconds per step (process
time) are recorded too: on a shared machine they move much less with the load than wall time, and
their ratios are reported alongside. Every run records the load average around it. Worker processes
run with ``OMP_WAIT_POLICY=PASSIVE`` (see ``--omp-wait-policy``).

Reported per setup (medians over rounds): useful tokens/s (non-padding label tokens a step trains on,
in expectation over the corpus: the recipe's step costs the same whatever its documents' lengths),
seconds/step, peak RSS, model FLOP/s (6 x active parameters x useful tokens/s; attention scores not
counted) and MFU against a matmul peak measured on the same machine in the setup's precision. Ratios
are per-round ratios, median over rounds. Also: the fraction of the corpus's tokens each setup trains
on at all (truncation drops the rest), and the slice of the corpus a benchmark run covers.

    PYTHONPATH=src .venvs/<stack>/bin/python benchmarks/train.py \\
        --model results/pinned/base/b-... --data results/pinned/data/d-.../target [--balance-modes]

``--shape qwen3-30b-a3b-router`` measures instead moeflow against the tuned Trainer at a real router and
vocabulary (benchmarks/real_shape.py: 128 experts, top-8, 151,936 entries on a small decoder; micro-batch 2 x
2,048 tokens, accumulation 4; synthetic packed rows; no --model/--data), each setup warming up with its own
loss, then one round per ``--vocab-sweep`` size for peak RSS against the vocabulary; written under
``shapes.<shape>.<stack>`` with the goals (peak RSS at most 0.5x the Trainer's, tokens/s at least 1.0x):

    PYTHONPATH=src .venvs/<stack>/bin/python benchmarks/train.py --shape qwen3-30b-a3b-router --rounds 2 --steps 2

``--balance-modes-only`` runs moeflow (off) and its three balancing-loss modes alone and adds them to
the stack's entry as ``balance_modes``.

Both stacks can take the same model folder and corpus (safetensors and Arrow), so they compare on
the same weights and rows. Writes this stack's entry of results/bench/train.json (``stacks.<stack>``;
the other stack's entry is kept).

Over 600 lines on purpose: the driver starts each measured run as this same file in a fresh process
(``--worker``), so the setups, the worker and the report stay in one script; the trainers it compares are
benchmarks/compared_trainers.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moeflow.settings import typed
from moeflow.train.settings import TrainSettings
from moeflow.workflow.keys import train_settings
from moeflow.workflow.load import load

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # moeflow, and benchmarks.* (the real shape)

from benchmarks.compared_trainers import (  # noqa: E402
    LR,
    chunked_loss,
    hf_loss,
    hf_train,
    moeflow_settings,
    packed_hf_batch,
    step_intervals,
    warm_up,
)

CORE_SETUPS = ("recipe", "tuned", "moeflow", "moeflow_bf16")
BALANCE_SETUPS = ("moeflow_running", "moeflow_exact", "moeflow_micro_batch")
LORA_SETUPS = ("moeflow_lora",)  # train.method: lora with the config's train.lora settings
MICRO, ACCUM, RECIPE_MAX_LENGTH = 2, 8, 2048
MATMUL_SIZE = 2048


def precision_of(setup: str) -> str:
    return "bf16" if setup.endswith("_bf16") else "fp32"


def balance_mode_of(setup: str) -> str:
    return setup[len("moeflow_") :] if setup in BALANCE_SETUPS else "off"


def stack_name() -> str:
    from moeflow.runtime import compat

    return "current" if compat.is_transformers_v5() else "pinned"


def documents(data_dir) -> list[list[int]]:
    from moeflow.data.shards import open_split, read_documents

    return [ids for _, ids in read_documents(open_split(data_dir, "train"))]


def packed_rows(data_dir) -> list[dict]:
    from moeflow.data.shards import open_split

    split = open_split(data_dir, "train")
    return [split[i] for i in range(len(split))]


def recipe_examples(docs, pad_id) -> list[dict]:
    """One document per example, truncated and padded to max_length (a multiple of 64 already)."""
    out = []
    for ids in docs:
        ids = ids[:RECIPE_MAX_LENGTH]
        pad = RECIPE_MAX_LENGTH - len(ids)
        out.append(
            {
                "input_ids": ids + [pad_id] * pad,
                "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": ids + [-100] * pad,
            }
        )
    return out


def label_tokens(example) -> int:
    """Non-ignored next-token targets of one example (labels shifted by one, as the loss sees them)."""
    return sum(1 for t in example["labels"][1:] if t != -100)


def matmul_peak(threads: int, dtype_name: str) -> dict[str, float]:
    """Best FLOP/s of a square matmul (MATMUL_SIZE) in ``dtype_name`` on this machine's CPU threads, per
    wall second and per process CPU second (the latter times ``threads``: the peak if the threads had
    their cores to themselves)."""
    import torch

    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    for _ in range(3):
        a @ b
    best = {"wall": 0.0, "cpu": 0.0}
    for _ in range(7):
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(4):
            a @ b
        flops = 4 * 2 * MATMUL_SIZE**3
        best["wall"] = max(best["wall"], flops / (time.perf_counter() - started))
        best["cpu"] = max(best["cpu"], flops * threads / max(time.process_time() - cpu_started, 1e-9))
    return best


def batch_shape(args) -> tuple[int, int]:
    """Micro-batch size and accumulation steps of this run: the real shape's, or the embedded default's."""
    if not args.shape:
        return MICRO, ACCUM
    from benchmarks.real_shape import SHAPES

    shape = SHAPES[args.shape]
    return shape.micro_batch_size, shape.grad_accum_steps


def model_and_examples(setup: str, args, timed: int):
    """The setup's model and training examples: the real shape's built from config (the same weights in every
    setup) and enough of its synthetic rows for ``timed`` steps, or the base model folder (with LoRA adapters
    for the LoRA setup: config/config.yaml's ``train.lora``) and the corpus."""
    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.folder import load_tokenizer
    from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings

    if args.shape:
        from benchmarks.real_shape import SHAPES, model_section, synthetic_rows

        shape = SHAPES[args.shape]
        rows = synthetic_rows(shape, args.vocab, timed * shape.micro_batch_size * shape.grad_accum_steps)
        return make_model(typed(ModelSettings, model_section(shape, args.vocab)), vocab_size=args.vocab), rows
    model_settings = {
        "pretrained": args.model,
        "config": {},  # not read for a folder
        "attn_implementation": "eager" if setup == "recipe" else "sdpa",
        "experts_implementation": STACK_DEFAULT_EXPERTS,  # what from_pretrained runs on this stack
    }
    train = (
        typed(TrainSettings, train_settings(load(overrides={"train": {"method": "lora"}})))
        if setup in LORA_SETUPS
        else None
    )
    layout = Layout.single("cpu", train)
    model = make_model(typed(ModelSettings, model_settings), folder=args.model, layout=layout)
    if setup == "recipe":
        return model, recipe_examples(documents(args.data), load_tokenizer(args.model).pad_token_id or 0)
    return model, packed_rows(args.data)


def worker(setup: str, args) -> dict:
    import torch

    from moeflow.data.collate import collate
    from moeflow.runtime.stage import set_offline
    from moeflow.train.metrics import active_parameters
    from moeflow.train.trainer import Trainer

    set_offline()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    timed = args.recipe_steps if setup == "recipe" else args.steps
    micro, accum = batch_shape(args)
    model, examples = model_and_examples(setup, args, timed)
    ends: list[float] = []  # perf_counter at the start of the first step, then at each step's end
    cpu_ends: list[float] = []

    def mark() -> None:
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())

    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision_of(setup) == "bf16")  # noqa: E731
    if setup.startswith("moeflow"):
        settings = moeflow_settings(timed, micro, accum, balance_mode_of(setup))
        warm_up(model, collate(examples[:micro]), autocast, chunked_loss)
        trainer = Trainer(
            model,
            settings,
            examples,
            collate_fn=collate,
            seed=0,
            precision=precision_of(setup),
            step_hook=lambda step, m: mark(),
        )
        train_step = trainer.train_step

        def first_step_begins():  # the loop has no hook before a step; the first one starts the clock
            if not ends:
                mark()
            return train_step()

        trainer.train_step = first_step_begins
        trainer.run()
    else:
        if setup == "recipe":

            def hf_batch(batch):
                return {k: torch.tensor([b[k] for b in batch]) for k in ("input_ids", "attention_mask", "labels")}
        else:
            hf_batch = packed_hf_batch(model)
        # The Trainer calls the model without use_cache: with the config's True, transformers 5 builds a cache and
        # then drops the per-document attention it reads from the restarting positions (moeflow's loop sets it off).
        model.config.use_cache = False
        checkpointing = setup == "recipe"
        if checkpointing:  # before the warm-up, so that its memory is the recipe's (the Trainer enables it again)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        warm_up(model, hf_batch(examples[:micro]), autocast, hf_loss)
        hf_train(model, examples, hf_batch, mark, micro=micro, accum=accum, steps=timed, checkpointing=checkpointing)

    seconds = statistics.median(step_intervals(ends))
    tokens_per_step = statistics.fmean(label_tokens(e) for e in examples) * micro * accum
    return {
        "setup": setup,
        "precision": precision_of(setup),
        "vocab_size": model.config.vocab_size,
        "useful_tokens_per_step": tokens_per_step,
        "useful_tokens_per_s": tokens_per_step / seconds,
        "seconds_per_step": seconds,
        "step_seconds": step_intervals(ends),
        "cpu_seconds_per_step": statistics.median(step_intervals(cpu_ends)),
        "cpu_seconds_per_useful_token": statistics.median(step_intervals(cpu_ends)) / tokens_per_step,
        "timed_steps": timed,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "flops_per_s": 6 * active_parameters(model) * tokens_per_step / seconds,
        "active_parameters": active_parameters(model),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }


def corpus_fractions(data_dir, steps: int, recipe_steps: int) -> dict:
    """What each setup can train on at all, and the slice of it one benchmark run covers."""
    docs = documents(data_dir)
    rows = packed_rows(data_dir)
    total = sum(len(d) for d in docs)
    recipe_kept = sum(min(len(d), RECIPE_MAX_LENGTH) for d in docs)
    per_step = MICRO * ACCUM
    return {
        "trained_tokens_fraction": {
            "recipe": recipe_kept / total,
            "tuned": 1.0,
            "moeflow": 1.0,
            "recipe_at_max_length_512": sum(min(len(d), 512) for d in docs) / total,
        },
        "benchmark_run_slice": {  # examples one run trains on / examples in the corpus
            "recipe": min(1.0, recipe_steps * per_step / len(docs)),
            "packed": min(1.0, steps * per_step / len(rows)),
        },
        "documents": len(docs),
        "packed_rows": len(rows),
        "seq_len": max(len(r["input_ids"]) for r in rows),
        "tokens": total,
    }


def median_ratio(runs: dict, top: str, bottom: str, key: str = "useful_tokens_per_s") -> float | None:
    if not runs.get(top) or not runs.get(bottom):
        return None
    return statistics.median(t[key] / b[key] for t, b in zip(runs[top], runs[bottom]))


def run_rounds(args, setups: tuple[str, ...], rounds: int, steps: int, vocab: int | None = None) -> dict[str, list]:
    """Each setup ``rounds`` times, each run a fresh worker process, the order rotated every round."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": str(args.threads),
        "OMP_WAIT_POLICY": args.omp_wait_policy,
    }
    inputs = (
        ["--shape", args.shape, "--vocab", str(vocab)] if args.shape else ["--model", args.model, "--data", args.data]
    )
    runs: dict[str, list] = {s: [] for s in setups}
    for round_ in range(rounds):
        shift = round_ % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            command = [sys.executable, __file__, "--worker", setup, *inputs, "--steps", str(steps)]
            command += ["--recipe-steps", str(args.recipe_steps), "--threads", str(args.threads)]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{setup} failed:\n{done.stderr[-4000:]}")
            result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
            runs[setup].append(result)
            print(
                f"round {round_ + 1} {setup}{f' vocab {vocab}' if vocab else ''}: "
                f"{result['seconds_per_step']:.2f} s/step, {result['useful_tokens_per_s']:.0f} useful tok/s, "
                f"{result['peak_rss_mib']:.0f} MiB, "
                f"load {result['load_average_1min'][0]:.1f}-{result['load_average_1min'][1]:.1f}",
                flush=True,
            )
    return runs


SUMMARY_KEYS = ("useful_tokens_per_s", "seconds_per_step", "cpu_seconds_per_step", "peak_rss_mib", "flops_per_s")


def summarise(runs: dict[str, list], peak: dict, cpu_peak: dict, threads: int) -> dict[str, dict]:
    """Per setup: the medians over rounds of :data:`SUMMARY_KEYS`, and MFU against the matmul peak."""
    summary = {}
    for setup, results in runs.items():
        summary[setup] = {key: statistics.median(r[key] for r in results) for key in SUMMARY_KEYS}
        summary[setup]["useful_tokens_per_step"] = results[0]["useful_tokens_per_step"]
        summary[setup]["mfu"] = summary[setup]["flops_per_s"] / peak[precision_of(setup)]
        # Model FLOPs per CPU second of the step against the matmul's: utilisation of the CPU time the step got.
        flops_per_cpu_second = (
            6 * results[0]["active_parameters"] / statistics.median(r["cpu_seconds_per_useful_token"] for r in results)
        )
        summary[setup]["mfu_of_cpu_time"] = flops_per_cpu_second * threads / cpu_peak[precision_of(setup)]
        summary[setup]["precision"] = precision_of(setup)
        summary[setup]["balance_mode"] = balance_mode_of(setup)
    return summary


def measured_peaks(peaks: dict[str, list]) -> tuple[dict, dict, dict]:
    """The best wall and CPU-time matmul FLOP/s per precision, and the record of every measurement."""
    peak = {p: max(m["wall"] for m in v) for p, v in peaks.items()}
    cpu_peak = {p: max(m["cpu"] for m in v) for p, v in peaks.items()}
    return (
        peak,
        cpu_peak,
        {"size": MATMUL_SIZE, **peak, "per_cpu_second_times_threads": cpu_peak, "measured_before_and_after": peaks},
    )


def machine(load_start, started: float) -> dict:
    import torch

    from moeflow.runtime import compat

    return {
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min_start_end": [load_start[0], os.getloadavg()[0]],
            "wall_seconds": time.perf_counter() - started,
        },
        "versions": {"torch": torch.__version__, "transformers": str(compat.version_of("transformers"))},
    }


def read_report(out: Path) -> dict:
    return json.loads(out.read_text()) if out.is_file() else {}


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


SHAPE_SETUPS = ("tuned", "moeflow")
SHAPE_GOALS = {"moeflow_over_tuned_peak_rss_at_most": 0.5, "moeflow_over_tuned_tokens_per_s_at_least": 1.0}


def vocabulary_sweep(sweep: dict[int, dict], summary: dict, shape_vocab: int, steps: int) -> dict:
    """Peak RSS (and tokens/s, from one round) against the vocabulary: the sweep's sizes and the shape's own
    (its medians over the rounds)."""
    by_vocab = {size: {s: r[s][0] for s in SHAPE_SETUPS} for size, r in sweep.items()}
    by_vocab[shape_vocab] = {
        s: {"peak_rss_mib": summary[s]["peak_rss_mib"], "useful_tokens_per_s": summary[s]["useful_tokens_per_s"]}
        for s in SHAPE_SETUPS
    }
    sizes = sorted(by_vocab)
    return {
        "peak_rss_mib": {s: {str(v): by_vocab[v][s]["peak_rss_mib"] for v in sizes} for s in SHAPE_SETUPS},
        "useful_tokens_per_s": {
            s: {str(v): by_vocab[v][s]["useful_tokens_per_s"] for v in sizes} for s in SHAPE_SETUPS
        },
        # Growth of the peak with the vocabulary, fitted over the sizes: the Trainer's follows tokens x vocabulary (a
        # micro-batch's logits, their log-softmax and gradients), moeflow's chunk x vocabulary + vocabulary x hidden.
        "peak_rss_mib_per_1000_entries": {
            s: 1000 * least_squares_slope(sizes, [by_vocab[v][s]["peak_rss_mib"] for v in sizes]) for s in SHAPE_SETUPS
        },
        "moeflow_over_tuned_peak_rss": {
            str(v): by_vocab[v]["moeflow"]["peak_rss_mib"] / by_vocab[v]["tuned"]["peak_rss_mib"] for v in sizes
        },
        "timed_steps_per_run": steps,
        "runs": {str(v): r for v, r in sweep.items()},
    }


def shape_benchmark(args) -> None:
    """moeflow against the tuned Trainer at the real shape (``args.rounds`` rounds at its vocabulary), then one
    round per ``--vocab-sweep`` size for peak RSS against the vocabulary; written to ``shapes.<shape>.<stack>``."""
    from benchmarks.real_shape import SHAPES, model_section

    shape = SHAPES[args.shape]
    started, load_start = time.perf_counter(), os.getloadavg()
    peaks = {"fp32": [matmul_peak(args.threads, "fp32")]}
    runs = run_rounds(args, SHAPE_SETUPS, args.rounds, args.steps, shape.vocab_size)
    sweep = {size: run_rounds(args, SHAPE_SETUPS, 1, args.sweep_steps, size) for size in args.vocab_sweep}
    peaks["fp32"].append(matmul_peak(args.threads, "fp32"))
    peak, cpu_peak, peak_record = measured_peaks(peaks)
    summary = summarise(runs, peak, cpu_peak, args.threads)
    ratios = {
        "moeflow_over_tuned_tokens_per_s": median_ratio(runs, "moeflow", "tuned"),
        "moeflow_over_tuned_tokens_per_cpu_second": median_ratio(
            runs, "tuned", "moeflow", "cpu_seconds_per_useful_token"
        ),
        "moeflow_over_tuned_peak_rss": median_ratio(runs, "moeflow", "tuned", "peak_rss_mib"),
    }
    report = {
        "setups": summary,
        "ratios": ratios,
        "goals": {
            **SHAPE_GOALS,
            "met": bool(
                ratios["moeflow_over_tuned_peak_rss"] <= SHAPE_GOALS["moeflow_over_tuned_peak_rss_at_most"]
                and ratios["moeflow_over_tuned_tokens_per_s"] >= SHAPE_GOALS["moeflow_over_tuned_tokens_per_s_at_least"]
            ),
        },
        "vocabulary_sweep": vocabulary_sweep(sweep, summary, shape.vocab_size, args.sweep_steps) if sweep else None,
        "matmul_peak_flops_per_s": peak_record,
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "shape": {
            "model": model_section(shape, shape.vocab_size),
            "seq_len": shape.seq_len,
            "micro_batch_size": shape.micro_batch_size,
            "grad_accum_steps": shape.grad_accum_steps,
            "lr": LR,
            "precision": "fp32",
        },
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy,
        **machine(load_start, started),
        "runs": runs,
    }
    out = Path(args.out)
    existing = read_report(out)
    shapes = existing.get("shapes", {})
    shapes[args.shape] = {**shapes.get(args.shape, {}), stack_name(): report}
    from moeflow.runtime.files import write_json

    write_json(out, {**existing, "shapes": shapes})
    print(json.dumps({"setups": summary, "ratios": ratios, "goals": report["goals"]}, indent=1))


def main() -> None:
    from benchmarks.real_shape import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="the base model folder (pretrain_base's output or a pretrained model)")
    parser.add_argument("--data", help="the fine-tuning corpus folder (the tokenize stage's output)")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        help="instead of --model/--data: moeflow against the tuned Trainer at a real router and vocabulary "
        "(benchmarks/real_shape.py), with a vocabulary sweep; written under shapes.<shape>.<stack>",
    )
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)  # a --shape worker's vocabulary size
    parser.add_argument(
        "--vocab-sweep",
        type=int,
        nargs="*",
        default=[32768, 65536],
        help="--shape: the smaller vocabulary sizes measured once each for peak RSS against the vocabulary",
    )
    parser.add_argument(
        "--sweep-steps",
        type=int,
        default=2,
        help="--shape: timed optimizer steps per sweep run (2: the second step's loss runs with AdamW's state "
        "allocated, so the peak is a training step's)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per packed-row run")
    parser.add_argument("--recipe-steps", type=int, default=1, help="timed optimizer steps per recipe run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        choices=("PASSIVE", "ACTIVE"),
        help="OpenMP threads sleep (PASSIVE) or spin (ACTIVE) while waiting; on a shared machine spinning threads "
        "that lose their core slow a step down many times over, so every setup runs PASSIVE by default",
    )
    parser.add_argument("--balance-modes", action="store_true", help="also run moeflow with each balancing-loss mode")
    parser.add_argument(
        "--balance-modes-only",
        action="store_true",
        help="run moeflow (off) and its balancing-loss modes only; adds them to this stack's entry as balance_modes",
    )
    parser.add_argument(
        "--lora-only",
        action="store_true",
        help="run moeflow's full fine-tune and its LoRA fine-tune only; "
        "adds them to this stack's entry as lora_vs_full",
    )
    parser.add_argument("--worker", choices=CORE_SETUPS + BALANCE_SETUPS + LORA_SETUPS)
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "train.json"))
    args = parser.parse_args()
    if not args.shape and not (args.model and args.data):
        parser.error("give --model and --data, or --shape")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return
    os.environ["OMP_WAIT_POLICY"] = (
        args.omp_wait_policy
    )  # before torch loads OpenMP: the matmul peak runs like the workers
    if args.shape:
        shape_benchmark(args)
        return

    if args.lora_only:
        setups = ("moeflow",) + LORA_SETUPS
    elif args.balance_modes_only:
        setups = ("moeflow",) + BALANCE_SETUPS
    else:
        setups = CORE_SETUPS + (BALANCE_SETUPS if args.balance_modes else ())
    separate = args.lora_only or args.balance_modes_only
    started = time.perf_counter()
    load_start = os.getloadavg()
    peaks = {p: [matmul_peak(args.threads, p)] for p in ("fp32", "bf16")}
    runs = run_rounds(args, setups, args.rounds, args.steps)
    for p in peaks:
        peaks[p].append(matmul_peak(args.threads, p))
    peak, cpu_peak, peak_record = measured_peaks(peaks)
    summary = summarise(runs, peak, cpu_peak, args.threads)
    pairs = (
        []
        if separate
        else [("moeflow", "recipe"), ("moeflow", "tuned"), ("tuned", "recipe"), ("moeflow_bf16", "moeflow")]
    )
    pairs += [(s, "moeflow") for s in setups if s in BALANCE_SETUPS + LORA_SETUPS]
    ratios = {f"{top}_over_{bottom}": median_ratio(runs, top, bottom) for top, bottom in pairs}
    # The same ratios from process CPU time per step (useful tokens per CPU second): less sensitive to the load.
    cpu_ratios = {
        f"{top}_over_{bottom}": median_ratio(runs, bottom, top, "cpu_seconds_per_useful_token") for top, bottom in pairs
    }
    report = {
        "setups": summary,
        "ratios_useful_tokens_per_s": ratios,
        "ratios_useful_tokens_per_cpu_second": cpu_ratios,
        "corpus": corpus_fractions(args.data, args.steps, args.recipe_steps),
        "matmul_peak_flops_per_s": peak_record,
        "rounds": args.rounds,
        "timed_steps_per_run": {"recipe": args.recipe_steps, "packed": args.steps},
        "shape": {
            "micro_batch_size": MICRO,
            "grad_accum_steps": ACCUM,
            "recipe_max_length": RECIPE_MAX_LENGTH,
            "lr": LR,
        },
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy,
        **machine(load_start, started),
        "inputs": {"model": args.model, "data": args.data},
        "runs": runs,
    }
    out = Path(args.out)
    existing = read_report(out)
    stacks = existing.get("stacks", {}) if isinstance(existing.get("stacks"), dict) else {}
    previous = stacks.get(stack_name(), {})
    if separate:
        report = {**previous, ("lora_vs_full" if args.lora_only else "balance_modes"): report}
    else:
        report["goals"] = {
            "moeflow_over_recipe_at_least": 2.0,
            "moeflow_over_tuned_at_least": 1.0,
            "met": bool(ratios["moeflow_over_recipe"] >= 2.0 and ratios["moeflow_over_tuned"] >= 1.0),
        }
        for key in ("balance_modes", "lora_vs_full"):  # separate runs' (each records its own versions and load)
            if key in previous:
                report[key] = previous[key]
    stacks[stack_name()] = report
    from moeflow.runtime.files import write_json

    write_json(out, {**existing, "stacks": dict(sorted(stacks.items()))})
    print(json.dumps({"setups": summary, "ratios": ratios, "cpu_ratios": cpu_ratios, "matmul_peak": peak}, indent=1))


if __name__ == "__main__":
    main()
