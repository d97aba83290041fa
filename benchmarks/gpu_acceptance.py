"""GPU acceptance: moeflow's Trainer and the HF Trainer on a Qwen3-30B-A3B-shaped slice, on one GPU.

The slice is config/models/qwen3-30b-a3b.yaml's qwen3_moe with its real layer dimensions (hidden 2048,
128 experts of width 768, top-8, vocabulary 151,936) and ``--layers`` decoder layers, built from config
on the GPU (no weights are downloaded). Both trainers take the same synthetic packed rows (2 documents a
row), micro-batch 2 x 2048 tokens, no accumulation, AdamW at benchmarks/compared_trainers.py's learning rate, bf16
autocast over fp32 weights, 20 steps after one untimed warm-up forward and backward (benchmarks/compared_trainers.py's
``warm_up``); moeflow's balancing loss is off, as the HF Trainer has none without router logits.

Per trainer, written to results/bench/gpu_acceptance.json: tokens/s (from the median step time), MFU
(6 x active parameters x tokens/s against the GPU's dense bf16 peak from :data:`BF16_PEAK_FLOPS_PER_S`),
peak allocated memory, host synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``'s
warnings, counted), and the attention and experts implementations the model ran. The experts implementation is
chosen as ``model.experts_implementation: auto`` is in the pipeline (moeflow.model.experts_choice, at the slice's
MoE layer shape, micro-batch and bf16 on the device); the report keeps its timings under ``experts_choice``.

``--dry``: tiny sizes on the CPU for a few steps, so CI keeps the script working without a GPU; host
synchronisations are then those tests/device_check.py counts, peak memory is the process's peak RSS and
MFU is against a nominal 1 TFLOP/s (a CPU has no table entry, and measuring its bf16 peak takes minutes).

    PYTHONPATH=src .venvs/<stack>/bin/python benchmarks/gpu_acceptance.py [--dry] [--layers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path[:0] = [str(REPO / "src"), str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from benchmarks.compared_trainers import hf_train, moeflow_settings, packed_hf_batch, step_intervals, warm_up  # noqa: E402
from benchmarks.synthetic_rows import two_document_rows  # noqa: E402
from moeflow.data.collate import collate  # noqa: E402
from moeflow.model.experts_choice import measure as time_experts  # noqa: E402
from moeflow.model.factory import make_model  # noqa: E402
from moeflow.model.settings import ModelSettings  # noqa: E402
from moeflow.runtime import compat  # noqa: E402
from moeflow.runtime.files import write_json  # noqa: E402
from moeflow.settings import typed  # noqa: E402
from moeflow.train.metrics import active_parameters  # noqa: E402
from moeflow.train.trainer import Trainer  # noqa: E402
from moeflow.workflow.load import load  # noqa: E402

# Dense bf16 tensor-core peak per GPU (vendor data sheets, without sparsity), by a word of its name.
BF16_PEAK_FLOPS_PER_S = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}
DRY_PEAK_FLOPS_PER_S = 1e12  # nominal: see the module doc
SLICE_CONFIG = REPO / "config" / "models" / "qwen3-30b-a3b.yaml"
TINY_SLICE = {  # --dry: the slice's family and routing, at test sizes
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}


@dataclass(frozen=True)
class Shape:
    layers: int
    seq_len: int
    micro_batch_size: int
    steps: int


FULL = Shape(layers=2, seq_len=2048, micro_batch_size=2, steps=20)
DRY = Shape(layers=2, seq_len=64, micro_batch_size=2, steps=3)


def slice_model_settings(layers: int, dry: bool) -> ModelSettings:
    """The model section of the Qwen3-30B-A3B config with ``layers`` decoder layers (tiny sizes if dry)."""
    slice_config = {"num_hidden_layers": layers, **(TINY_SLICE if dry else {})}
    return typed(ModelSettings, load(SLICE_CONFIG, overrides={"model": {"config": slice_config}})["model"])


def peak_flops_per_s(device: torch.device) -> tuple[float | None, str]:
    """The device's dense bf16 peak and where it comes from."""
    if device.type != "cuda":
        return DRY_PEAK_FLOPS_PER_S, "nominal (dry run on the CPU)"
    name = torch.cuda.get_device_name(device)
    found = next((peak for word, peak in BF16_PEAK_FLOPS_PER_S.items() if word in name.split()), None)
    return found, f"table ({name})" if found else f"unknown GPU {name!r}: add it to BF16_PEAK_FLOPS_PER_S"


@contextlib.contextmanager
def host_syncs(model: torch.nn.Module) -> Iterator[list]:
    """Count the host synchronisations of the body: CUDA's sync debug warnings, or on the CPU those
    tests/device_check.py records. Yields a list that holds one entry per synchronisation afterwards."""
    found: list = []
    if next(model.parameters()).device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.extend(w for w in caught if "synchroniz" in str(w.message))
        return
    from device_check import DeviceCheck

    with DeviceCheck() as check:
        check.place_model(model)
        yield found
    found.extend(check.syncs)


def run_moeflow(model, rows, shape: Shape, mark: Callable[[], None]) -> None:
    settings = moeflow_settings(shape.steps, shape.micro_batch_size, 1)
    trainer = Trainer(
        model, settings, rows, collate_fn=collate, seed=0, precision="bf16", step_hook=lambda step, m: mark()
    )
    mark()  # the loop has no hook before its first step
    trainer.run()


def run_hf_trainer(model, rows, shape: Shape, mark: Callable[[], None]) -> None:
    """The HF Trainer on moeflow's packed rows (benchmarks/train.py's ``tuned`` setup), in bf16."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    collator = packed_hf_batch(model)
    hf_train(
        model, rows, collator, mark, micro=shape.micro_batch_size, accum=1, steps=shape.steps, bf16=True, use_cpu=on_cpu
    )


SETUPS = {"moeflow": run_moeflow, "hf_trainer": run_hf_trainer}


def measure(setup: str, settings: ModelSettings, rows: list[dict], shape: Shape, device: torch.device, peak) -> dict:
    """One trainer on a freshly built slice (the same weights for every setup), built on the device."""
    with device:
        model = make_model(settings, vocab_size=int(settings.config["vocab_size"]), seed=0, device=device)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    warm_up(model, collate(rows[: shape.micro_batch_size]), autocast)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    marks: list[float] = []
    with host_syncs(model) as syncs:
        SETUPS[setup](model, rows, shape, lambda: marks.append(time.perf_counter()))
    seconds = statistics.median(step_intervals(marks))
    tokens_per_step = shape.micro_batch_size * shape.seq_len
    tokens_per_s = tokens_per_step / seconds
    active = active_parameters(model)
    if device.type == "cuda":
        peak_memory_mib = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS
    result = {
        "tokens_per_step": tokens_per_step,
        "seconds_per_step": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": 6 * active * tokens_per_s / peak if peak else None,
        "peak_allocated_mib": peak_memory_mib,
        "host_syncs_per_step": len(syncs) / shape.steps,
        "active_parameters": active,
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None) or "eager",
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, a few steps (CI)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the slice (2-4; default 2)")
    parser.add_argument(
        "--smoke-pipeline-seconds",
        type=float,
        default=None,
        help="how long the driver's smoke pipeline on cuda took (gpu_acceptance.sh), recorded in the report",
    )
    parser.add_argument("--out", default=None, help="default: results/bench/gpu_acceptance.json (.dry.json if --dry)")
    args = parser.parse_args()
    out = args.out or str(REPO / "results" / "bench" / f"gpu_acceptance{'.dry' if args.dry else ''}.json")
    started = time.perf_counter()
    shape = DRY if args.dry else FULL
    if args.layers:
        shape = Shape(args.layers, shape.seq_len, shape.micro_batch_size, shape.steps)
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a machine with a GPU, or use --dry")
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    torch.manual_seed(0)
    settings = slice_model_settings(shape.layers, args.dry)
    experts = time_experts(settings, shape.micro_batch_size, shape.seq_len, device, "bf16")
    print(f"experts implementation: {experts['chosen']} ({experts['reason']})", flush=True)
    settings = dataclasses.replace(settings, experts_implementation=experts["chosen"])  # as the stages resolve auto
    vocab = int(settings.config["vocab_size"])
    rows = two_document_rows(shape.micro_batch_size * (shape.steps + 1), shape.seq_len, vocab)
    peak, peak_source = peak_flops_per_s(device)
    setups = {}
    for setup in SETUPS:
        setups[setup] = measure(setup, settings, rows, shape, device, peak)
        print(f"{setup}: {setups[setup]}", flush=True)
    report = {
        "dry": args.dry,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_flops_per_s": peak,
        "peak_flops_source": peak_source,
        "shape": asdict(shape),
        "model": {k: settings.config[k] for k in ("hidden_size", "num_experts", "moe_intermediate_size")}
        | {"num_experts_per_tok": settings.config["num_experts_per_tok"], "vocab_size": vocab},
        "setups": setups,
        "experts_choice": experts,
        "moeflow_over_hf_tokens_per_s": setups["moeflow"]["tokens_per_s"] / setups["hf_trainer"]["tokens_per_s"],
        "smoke_pipeline_seconds": args.smoke_pipeline_seconds,
        "versions": {"torch": torch.__version__, "transformers": str(compat.version_of("transformers"))},
        "wall_seconds": time.perf_counter() - started,
    }
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
