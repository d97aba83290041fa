"""Two measurements behind training defaults, on the embedded default's model shape (config/config.yaml):

1. ``precision``: time of one optimizer step's gradients (2 micro-batches of micro_batch_size x seq_len
   tokens) in fp32 and in bf16 autocast, alternating the two over ``--rounds`` rounds in one process
   (so both see the same machine load); the median ratio chose ``precision`` in config/config.yaml.
2. ``balance_modes``: how far the ``running`` global-batch balancing loss is from ``exact`` at 8
   accumulation steps: relative norm of the difference of the balancing term's gradient contribution
   (total gradient minus the CE-only gradient), for ``running`` and the classic ``micro_batch``.

    PYTHONPATH=src python benchmarks/training_maths.py [--model DIR --data DIR] [--rounds 7] [--threads 2]

With ``--model`` (a saved base model, e.g. results/pinned/base/b-...) and ``--data`` (a tokenized corpus
folder) the balance-mode measurement uses real routing and text; otherwise a randomly initialised model
of the default shape on random tokens. Writes results/bench/training_maths.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from moeflow.data.collate import collate  # noqa: E402
from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model.experts_choice import measure as time_experts  # noqa: E402
from moeflow.model.routing import adapter_or_none  # noqa: E402
from moeflow.model.settings import ModelSettings  # noqa: E402
from moeflow.runtime import compat  # noqa: E402
from moeflow.settings import typed  # noqa: E402
from moeflow.train.settings import BalanceSettings  # noqa: E402
from moeflow.train.trainer import accumulate_gradients  # noqa: E402
from moeflow.workflow.load import load, run_config  # noqa: E402


def random_rows(n, seq_len, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
        rows.append(
            {
                "input_ids": ids,
                "labels": [-100] + ids[1:],
                "position_ids": list(range(seq_len)),
                "doc_ids": [i] * seq_len,
            }
        )
    return rows


def gradient(model, batches, settings, adapter):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, batches, settings, adapter)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a saved base model folder")
    parser.add_argument("--data", help="a tokenized corpus folder (its train split is used)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "training_maths.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = run_config(load(), "moe")
    train, seq_len = cfg["train"], cfg["data"]["seq_len"]
    model_settings = typed(ModelSettings, cfg["model"])
    experts = time_experts(model_settings, train["micro_batch_size"], seq_len, torch.device("cpu"), "fp32")["chosen"]
    # as make_model resolves auto from rule choose_experts's choice
    model_settings = dataclasses.replace(model_settings, experts_implementation=experts)
    model = make_model(model_settings, vocab_size=cfg["tokenizer"]["vocab_size"], seed=0)
    adapter = adapter_or_none(model)
    micro = train["micro_batch_size"]

    # 1. precision
    rows = random_rows(2 * micro, seq_len, cfg["tokenizer"]["vocab_size"])
    batches = [collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]
    times = {"fp32": [], "bf16": []}
    for _ in range(args.rounds):
        for precision in times:
            autocast = lambda precision=precision: torch.autocast(  # noqa: E731
                "cpu", dtype=torch.bfloat16, enabled=precision == "bf16"
            )
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            accumulate_gradients(model, batches, typed(BalanceSettings, {}), adapter, autocast)
            times[precision].append(time.perf_counter() - started)
    medians = {p: statistics.median(t) for p, t in times.items()}
    tokens = len(rows) * seq_len
    precision_result = {
        "tokens_per_step": tokens,
        "median_seconds": medians,
        "tokens_per_s": {p: tokens / s for p, s in medians.items()},
        "bf16_over_fp32_time": medians["bf16"] / medians["fp32"],
        "rounds": args.rounds,
    }
    print(json.dumps(precision_result, indent=1))

    # 2. balance modes at 8 accumulation steps
    if args.model:
        from moeflow.data.shards import open_split

        model = make_model(model_settings, folder=args.model)
        adapter = adapter_or_none(model)
        split = open_split(args.data, "train")
        rows = [split[i] for i in range(min(len(split), 8 * micro))]
    else:
        rows = random_rows(8 * micro, seq_len, cfg["tokenizer"]["vocab_size"], seed=1)
    batches = [collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]
    grads = {
        mode: gradient(
            model,
            batches,
            typed(BalanceSettings, {"mode": mode, "coef": train["balance"]["coef"]}),
            adapter,
        )
        for mode in ("exact", "running", "micro_batch", "off")
    }
    exact_term = grads["exact"] - grads["off"]
    balance_result = {
        "accumulation_steps": len(batches),
        "tokens_per_micro_batch": sum(len(r["input_ids"]) for r in rows) // len(batches),
        "model": args.model or "random init, default shape",
        "balancing_gradient_gap_to_exact": {
            mode: float(((grads[mode] - grads["off"]) - exact_term).norm() / exact_term.norm())
            for mode in ("running", "micro_batch")
        },
        "total_gradient_gap_to_exact": {
            mode: float((grads[mode] - grads["exact"]).norm() / grads["exact"].norm())
            for mode in ("running", "micro_batch")
        },
    }
    print(json.dumps(balance_result, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "precision": precision_result,
                "balance_modes": balance_result,
                "stack": {"torch": torch.__version__, "transformers": str(compat.version_of("transformers"))},
                "threads": args.threads,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
