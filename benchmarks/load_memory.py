"""Benchmark: peak host memory of a model load, moeflow's (built on the meta device, then filled from the files)
against transformers' ``from_pretrained``.

    python benchmarks/load_memory.py                   # a ~277M-parameter qwen3_moe, fp32 and bf16 folders
    python benchmarks/load_memory.py --experts 64      # larger (the experts dominate)
    python benchmarks/load_memory.py --ep              # parallel.strategy: ep on 2 gloo ranks, fp32 (each rank)

A qwen3_moe model is built from its config and saved once per dtype; each load runs in a fresh process, which
reports its resident set before the load (imports done) and its high-water mark after it (``VmHWM`` of
/proc/self/status), both in MiB. ``over`` is the peak above the baseline over the whole model's weights' size
(under ``--ep``: of the rank with the largest load). Writes results/bench/load_memory.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
DTYPES = ("float32", "bfloat16")


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def qwen3_moe_config(experts: int) -> dict:
    return {
        "model_type": "qwen3_moe",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 4,
        "tie_word_embeddings": False,
    }


def _settings(experts: int):
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    return typed(ModelSettings, {"config": qwen3_moe_config(experts), "experts_implementation": "eager"})


def save(folder: Path, experts: int, dtype: str) -> int:
    import torch

    from moeflow.loading.factory import make_model

    model = make_model(_settings(experts), vocab_size=32000, seed=0).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load(folder: str, how: str, dtype: str, experts: int) -> None:
    """One load in this process; prints its baseline and peak RSS (MiB) as JSON."""
    import torch

    torch.set_num_threads(1)
    from moeflow.model.configs import build_config

    # the model classes' lazy imports before the baseline, not counted as the load's
    config_module = type(build_config(qwen3_moe_config(experts), 32000)).__module__
    importlib.import_module(config_module.replace("configuration", "modeling"))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        base = status_mib("VmRSS")
        model = _load(folder, how, dtype, experts, None)
        peak = status_mib("VmHWM")
        print(json.dumps({"base_mib": round(base, 1), "peak_mib": round(peak, 1)}))
        return
    from moeflow.parallel.process_group import process_group

    with process_group("cpu") as ranks:
        base = status_mib("VmRSS")
        model = _load(folder, how, dtype, experts, ranks)
        peak = status_mib("VmHWM")
        print(json.dumps({"rank": ranks.rank, "base_mib": round(base, 1), "peak_mib": round(peak, 1)}), flush=True)
    del model


def _load(folder: str, how: str, dtype: str, experts: int, ranks):
    import torch

    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.configs import causal_lm_class
    from moeflow.parallel.layouts import distributed_config
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.settings import typed

    kwargs, layout = {}, None
    if ranks is not None:
        parallel = typed(ParallelSettings, {"strategy": "ep", "ep_size": 2, "fsdp_size": 2, "nproc_per_node": 2})
        kwargs, layout = {"distributed_config": distributed_config(parallel, "fp32")}, Layout(ranks, parallel)
    if how == "from_pretrained":
        return causal_lm_class().from_pretrained(folder, torch_dtype=getattr(torch, dtype), **kwargs)
    return make_model(_settings(experts), folder=folder, dtype=getattr(torch, dtype), layout=layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--ep", action="store_true", help="parallel.strategy: ep on 2 gloo ranks (fp32)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "load_memory.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32",) if args.ep else DTYPES:
            folder = Path(tmp) / dtype
            weights = save(folder, args.experts, dtype) / 2**20
            for how in ("from_pretrained", "moeflow"):
                launch = [sys.executable]
                if args.ep:
                    from moeflow.parallel.launch import torchrun_command

                    launch = shlex.split(torchrun_command(sys.executable, cpu_ranks=2))
                cmd = [*launch, __file__, "--load", str(folder), how, dtype, str(args.experts)]
                env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
                stdout = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                found = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
                out = max(found, key=lambda r: r["peak_mib"] - r["base_mib"])  # the rank with the largest load
                over = (out["peak_mib"] - out["base_mib"]) / weights
                rows.append(
                    {"dtype": dtype, "load": how, "weights_mib": round(weights, 1), **out, "over": round(over, 2)}
                    | ({"strategy": "ep", "ranks": 2} if args.ep else {})
                )
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
