"""GPU acceptance: moeflow's Trainer and the HF Trainer on a Qwen3-30B-A3B-shaped slice, on one GPU.

The slice is config/models/qwen3-30b-a3b.yaml's qwen3_moe with its real layer dimensions (hidden 2048,
128 experts of width 768, top-8, vocabulary 151,936) and enough decoder layers that the experts, not the
151,936-entry head, bear most of the FLOPs: ``--layers`` or, by default, the most (up to 16) whose weights,
gradients, AdamW states and activations fit in 70% of the GPU's memory (14 on an H200 in bf16). Built from config on
the GPU (no weights are downloaded) in ``--weights`` (bf16: weights, gradients and AdamW states in bf16, so
that grouped GEMMs run in bf16), both trainers take the same synthetic packed rows (2 documents a row),
micro-batch 2 x 2048 tokens, no accumulation, AdamW at benchmarks/compared_trainers.py's learning rate, under bf16
autocast, 20 steps after one untimed warm-up forward and backward with the loss the setup trains on (moeflow's
chunked cross-entropy, the HF Trainer's own from the full logits); moeflow's balancing loss is off, as the HF
Trainer has none without router logits.

Per trainer, written to one JSON file (default results/bench/gpu_acceptance.json, rewritten after each
trainer): tokens/s (from the median step time), MFU over the FLOP-bearing parameters a token passes through
(6 x (head + the top-k of the routed experts + everything else in the layers; the input embedding is a lookup)
x tokens/s against the GPU's dense bf16 peak from :data:`BF16_PEAK_FLOPS_PER_S`), the same without the head
(``mfu_layers``) and the head's share of those FLOPs (``flops_per_token``), peak allocated memory, host
synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``'s warnings, counted), and the attention
and experts implementations the model ran. The experts implementation is chosen as
``model.experts_implementation: auto`` is in the pipeline (moeflow.model.experts_choice, at the slice's MoE layer
shape, micro-batch and bf16 on the device) unless ``--experts`` names one; the report keeps its timings under
``experts_choice``. ``--parts`` merges what benchmarks/gpu_acceptance.sh measured before (the bundle's install,
the smoke pipeline) into the same file.

``--dry``: tiny sizes on the CPU for a few steps, so CI keeps the script working without a GPU; host
synchronisations are then those tests/device_check.py counts, peak memory is the process's peak RSS and
MFU is against a nominal 1 TFLOP/s (a CPU has no table entry, and measuring its bf16 peak takes minutes).

    PYTHONPATH=src python benchmarks/gpu_acceptance.py [--dry] [--layers N] [--weights bf16|fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
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

from benchmarks.compared_trainers import (  # noqa: E402
    chunked_loss,
    hf_loss,
    hf_train,
    moeflow_settings,
    packed_hf_batch,
    step_intervals,
    warm_up,
)
from benchmarks.synthetic_rows import two_document_rows  # noqa: E402
from moeflow.data.collate import collate  # noqa: E402
from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model import parameters as P  # noqa: E402
from moeflow.model.experts_choice import measure as time_experts  # noqa: E402
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


FULL = Shape(layers=0, seq_len=2048, micro_batch_size=2, steps=20)  # layers 0: as many as fit (fitting_layers)
DRY = Shape(layers=2, seq_len=64, micro_batch_size=2, steps=3)
MAX_LAYERS = 16
MEMORY_SHARE = 0.7  # of the GPU's memory the layer choice plans for (the rest: allocator slack, the CUDA context)


def slice_model_settings(layers: int, dry: bool, experts: str | None = None) -> ModelSettings:
    """The model section of the Qwen3-30B-A3B config with ``layers`` decoder layers (tiny sizes if dry)."""
    slice_config = {"num_hidden_layers": layers, **(TINY_SLICE if dry else {})}
    model = {"config": slice_config} | ({"experts_implementation": experts} if experts else {})
    return typed(ModelSettings, load(SLICE_CONFIG, overrides={"model": model})["model"])


def layer_and_outer_parameters(config: dict) -> tuple[int, int]:
    """Parameters of one qwen3_moe decoder layer (attention, router, routed experts, norms) and of the rest
    (input embedding, head, final norm), from the slice's config."""
    hidden, head_dim = int(config["hidden_size"]), int(config["head_dim"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    experts, width = int(config["num_experts"]), int(config["moe_intermediate_size"])
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim
    layer = attention + hidden * experts + experts * 3 * hidden * width + 2 * hidden
    return layer, 2 * int(config["vocab_size"]) * hidden + hidden


def fitting_layers(config: dict, shape: Shape, weight_bytes: int, memory_bytes: int) -> int:
    """The most decoder layers (2 to MAX_LAYERS) whose training state fits in MEMORY_SHARE of ``memory_bytes``:
    weights and gradients at ``weight_bytes``, AdamW's two states in the weights' dtype, plus activations (an
    allowance of 64 bf16 hidden vectors a token a layer, and the HF Trainer's full logits in bf16 and fp32 with
    their gradient)."""
    layer, outer = layer_and_outer_parameters(config)
    tokens = shape.micro_batch_size * shape.seq_len
    state = 4 * weight_bytes  # weights, gradients, exp_avg, exp_avg_sq
    logits = tokens * int(config["vocab_size"]) * (2 + 4 + 4 + 2)
    per_layer = layer * state + tokens * int(config["hidden_size"]) * 64 * 2
    room = MEMORY_SHARE * memory_bytes - outer * state - logits
    return max(2, min(MAX_LAYERS, int(room // per_layer)))


def flops_per_token(model: torch.nn.Module) -> dict[str, float]:
    """Training FLOPs a token costs, by where they are: 6 x the parameters it passes through, in the head, in
    the routed experts (top-k of them) and in the rest of the layers (attention, routers, norms; the input
    embedding is a lookup and counts for nothing). A tied head counts as the embedding's size. Attention's
    score products are not counted (as in :func:`moeflow.train.metrics.active_parameters`)."""
    config = model.config
    experts = getattr(config, "num_experts", None) or 1
    share = (getattr(config, "num_experts_per_tok", None) or experts) / experts
    counts = {"head": 0.0, "experts": 0.0, "layers": 0.0}
    embedding = 0
    for name, parameter in model.named_parameters():
        category = P.counted_category(name)
        if category == P.EMBEDDING:
            embedding += parameter.numel()
        elif category == P.LM_HEAD:
            counts["head"] += parameter.numel()
        elif category == P.ROUTED_EXPERTS:
            counts["experts"] += parameter.numel() * share
        else:
            counts["layers"] += parameter.numel()
    if not counts["head"] and getattr(config, "tie_word_embeddings", False):
        counts["head"] = float(embedding)
    flops = {where: 6 * n for where, n in counts.items()}
    total = sum(flops.values())
    return flops | {"total": total, "head_share": flops["head"] / total, "experts_share": flops["experts"] / total}


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


def moeflow_warm_up(model, rows, autocast) -> None:
    warm_up(model, collate(rows), autocast, loss=chunked_loss)


def hf_warm_up(model, rows, autocast) -> None:
    warm_up(model, packed_hf_batch(model)(rows), autocast, loss=hf_loss)


# Each setup: its training loop and its warm-up (the loss it trains on: moeflow's chunked one never makes the logits).
SETUPS = {"moeflow": (run_moeflow, moeflow_warm_up), "hf_trainer": (run_hf_trainer, hf_warm_up)}


def measure(setup: str, settings: ModelSettings, rows: list[dict], shape: Shape, device, peak, dtype) -> dict:
    """One trainer on a freshly built slice (the same weights for every setup), built on the device."""
    with device:
        model = make_model(settings, vocab_size=int(settings.config["vocab_size"]), seed=0, device=device)
    model.to(dtype)
    train, warm = SETUPS[setup]
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    warm(model, rows[: shape.micro_batch_size], autocast)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    marks: list[float] = []
    with host_syncs(model) as syncs:
        train(model, rows, shape, lambda: marks.append(time.perf_counter()))
    seconds = statistics.median(step_intervals(marks))
    tokens_per_step = shape.micro_batch_size * shape.seq_len
    tokens_per_s = tokens_per_step / seconds
    flops = flops_per_token(model)
    if device.type == "cuda":
        peak_memory_mib = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS
    layer_flops = flops["experts"] + flops["layers"]
    result = {
        "tokens_per_step": tokens_per_step,
        "seconds_per_step": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": flops["total"] * tokens_per_s / peak if peak else None,
        "mfu_layers": layer_flops * tokens_per_s / peak if peak else None,
        "flops_per_token": flops,
        "peak_allocated_mib": peak_memory_mib,
        "host_syncs_per_step": len(syncs) / shape.steps,
        "active_parameters": active_parameters(model),
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None) or "eager",
    }
    del model
    gc.collect()  # the HF Trainer's objects hold the model and its optimizer in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, a few steps (CI)")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"decoder layers of the slice (default: as many as fit, at most {MAX_LAYERS})",
    )
    parser.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="the slice's parameter dtype")
    parser.add_argument(
        "--experts", default=None, help="an experts implementation instead of the pipeline's auto choice"
    )
    parser.add_argument(
        "--parts", default=None, help="a JSON file of the parts gpu_acceptance.sh ran before, merged in"
    )
    parser.add_argument("--out", default=None, help="default: results/bench/gpu_acceptance.json (.dry.json if --dry)")
    args = parser.parse_args()
    out = args.out or str(REPO / "results" / "bench" / f"gpu_acceptance{'.dry' if args.dry else ''}.json")
    started = time.perf_counter()
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a machine with a GPU, or use --dry")
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.weights]
    shape = DRY if args.dry else FULL
    layers = args.layers or shape.layers
    if not layers:
        config = slice_model_settings(2, args.dry).config
        memory = torch.cuda.get_device_properties(device).total_memory
        layers = fitting_layers(config, shape, dtype.itemsize, memory)
    shape = dataclasses.replace(shape, layers=layers)
    torch.manual_seed(0)
    settings = slice_model_settings(shape.layers, args.dry, args.experts)
    experts = time_experts(settings, shape.micro_batch_size, shape.seq_len, device, "bf16")
    print(f"experts implementation: {experts['chosen']} ({experts['reason']})", flush=True)
    settings = dataclasses.replace(settings, experts_implementation=experts["chosen"])  # as the stages resolve auto
    vocab = int(settings.config["vocab_size"])
    rows = two_document_rows(shape.micro_batch_size * (shape.steps + 1), shape.seq_len, vocab)
    peak, peak_source = peak_flops_per_s(device)
    parts = json.loads(Path(args.parts).read_text()) if args.parts else {}
    report = {
        "dry": args.dry,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_flops_per_s": peak,
        "peak_flops_source": peak_source,
        "shape": asdict(shape),
        "model": {k: settings.config[k] for k in ("hidden_size", "num_experts", "moe_intermediate_size")}
        | {"num_experts_per_tok": settings.config["num_experts_per_tok"], "vocab_size": vocab, "weights": args.weights},
        "setups": {},
        "experts_choice": experts,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": str(compat.version_of("transformers")),
        },
        "parts": parts,
    }
    for setup in SETUPS:
        report["setups"][setup] = measure(setup, settings, rows, shape, device, peak, dtype)
        print(f"{setup}: {report['setups'][setup]}", flush=True)
        done = report["setups"]
        if len(done) == len(SETUPS):
            report["moeflow_over_hf_tokens_per_s"] = (
                done["moeflow"]["tokens_per_s"] / done["hf_trainer"]["tokens_per_s"]
            )
        report["benchmark_seconds"] = time.perf_counter() - started
        write_json(out, report)  # after each trainer: a run stopped at its time limit keeps what it measured
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
