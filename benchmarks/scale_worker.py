"""One rank of benchmarks/scale.py (and tests/pipeline/test_phase_memory.py): the phases that move the whole
training state, each measured on this rank.

    python benchmarks/scale_worker.py build MODEL_DIR
        the benchmark model (:data:`MODEL_CONFIG`, fp32, seed 0) saved HF-sharded into MODEL_DIR, once

    python -m torch.distributed.run --standalone --nproc_per_node N benchmarks/scale_worker.py run \\
        MODEL_DIR OUT_DIR --strategy fsdp|ep [--export-shard-size 200MB]
        the phases in order on gloo ranks, one thread each; rank 0 writes OUT_DIR/phases.json

The phases: ``load`` (the training load of MODEL_DIR: ``moeflow.loading.factory.make_model`` for the layout, or the
baseline's ``distributed.load_for_training``); ``step`` (a Trainer's ``train_step`` in the steady state the
planner plans: AdamW's moments are alive through the backward pass, made beforehand, unmeasured, by the step on
zero gradients a resume gives a fresh optimizer, ``torch.distributed.checkpoint``'s ``_init_optim_state``: a
training step would cost as much as the measured one, its forward and backward pass and FSDP's gathers included);
``checkpoint`` (``Trainer.save``); ``resume`` (the first model and
Trainer freed, then a fresh ``load_for_training``, Trainer and ``Trainer.load``; without reading the base
weights where ``load_for_training`` takes ``weights=False``, as train_model does when a checkpoint replaces
them); ``export`` (the final model: ``moeflow.export.save_final_model``, a collective, where the package has
it; else the old design, ``distributed.whole_model`` then ``modeling.save_final_model`` on rank 0).

Per phase and rank: the peak RSS of the phase (the kernel's high-water mark reset through
``/proc/self/clear_refs`` before the phase, ``VmHWM`` read after it), the RSS at its start (both less the
file-backed pages, ``RssFile`` and ``RssShmem``, as moeflow.train.peak_memory measures), its seconds
(barrier to barrier: the slowest rank's), this rank's CPU seconds (user + system) and the bytes this rank
wrote (``write_bytes`` of ``/proc/self/io``).
RSS measures what is live only if freed tensors go back to the kernel: the driver sets
``MALLOC_MMAP_THRESHOLD_`` (see benchmarks/scale.py), recorded here.

The worker uses only APIs that both the baseline commit and the new design have, so that the driver can
measure both with the same file: it imports ``moeflow`` from PYTHONPATH (the driver puts the design's
``src`` first).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import inspect
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

# benchmarks.synthetic_rows: torch only, so it leaves the moeflow on PYTHONPATH (this tree's or the baseline's) alone
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.synthetic_rows import two_document_rows  # noqa: E402

# Attention 16 x 64 (4 KV heads), 16 experts of width 384, top-2, every layer MoE, untied output layer (expert
# parallelism refuses tied ones): 239M parameters, 67M of them the embedding and the output layer.
MODEL_CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}
VOCAB = 32_000
SEQ_LEN, MICRO_BATCH = 64, 2  # 2 x 64 tokens a rank: the state, not the activations, sets the memory
LOSS_CHUNK_TOKENS = 1024
MODEL_SECTION = {
    "config": MODEL_CONFIG,
    "experts_implementation": "eager",  # what experts_implementation: auto picks on this CPU (benchmarks/real_shape.py)
    "attn_implementation": "sdpa",
    "loss_chunk_tokens": LOSS_CHUNK_TOKENS,
}
TRAIN = {
    "steps": 2,
    "lr": 1e-4,
    "min_lr": 1e-5,
    "warmup_steps": 0,
    "micro_batch_size": MICRO_BATCH,
    "grad_accum_steps": 1,
    "gradient_checkpointing": False,
}
# --method: (train section, model section, precision) over TRAIN and MODEL_SECTION. LoRA in bf16, as on a GPU: its
# frozen base is held in bf16 (moeflow.loading.factory.Layout.weights_dtype); QLoRA's in NF4, with the gradient
# checkpointing it requires (this tree only).
METHODS = {
    "full": ({}, {}, "fp32"),
    "lora": ({"method": "lora", "lora": {"rank": 16}}, {}, "bf16"),
    "qlora": (
        {"method": "lora", "lora": {"rank": 16}, "gradient_checkpointing": True},
        {"quantization": "nf4"},
        "bf16",
    ),
}
METHOD = "full"  # run()'s --method
PHASES = ("load", "step", "checkpoint", "resume", "export")
SAVE_SHARD_SIZE = "200MB"  # the saved model folder: HF-sharded, as a user's large model comes
MIB = 2**20


def model_section() -> dict:
    return {**MODEL_SECTION, "config": {**MODEL_CONFIG, "vocab_size": VOCAB}, **METHODS[METHOD][1]}


def precision() -> str:
    return METHODS[METHOD][2]


def packages() -> bool:
    """Whether moeflow is laid out in packages (this tree) or in the baseline commit's flat modules."""
    return importlib.util.find_spec("moeflow.runtime") is not None


def distributed():
    """The process group and training load: ``moeflow.parallel`` and ``moeflow.loading.factory.make_model``, or the
    baseline's ``moeflow.distributed``."""
    if not packages():
        from moeflow import distributed as D

        return D
    from moeflow.parallel import process_group

    return argparse.Namespace(
        init=process_group.init,
        check_ranks=process_group.check_ranks,
        barrier=process_group.barrier,
        gather_objects=process_group.gather_objects,
        teardown=process_group.teardown,
        load_for_training=load_for_training,
    )


def load_for_training(model_dir, model_cfg, train, parallel, ranks, precision: str, weights: bool = True):
    """The baseline's ``load_for_training`` through this tree's factory: the model for the layout, as the
    warmup and train_model stages make it."""
    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    layout = Layout(ranks, parallel, train, precision)
    return make_model(typed(ModelSettings, model_cfg), folder=model_dir, layout=layout, weights=weights)


def train_settings():
    if not packages():
        from moeflow import config as mfconfig

        return mfconfig.settings(mfconfig.TrainSettings, mfconfig.training(TRAIN))
    from moeflow.settings import typed
    from moeflow.train.settings import TrainSettings
    from moeflow.workflow.keys import training

    return typed(TrainSettings, training({**TRAIN, **METHODS[METHOD][0]}))


def parallel_settings(strategy: str, world: int):
    section = {"strategy": strategy, "nproc_per_node": world} | ({"ep_size": world} if strategy == "ep" else {})
    if not packages():
        from moeflow import config as mfconfig

        return mfconfig.settings(mfconfig.ParallelSettings, section)
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.settings import typed

    return typed(ParallelSettings, section)


class NoTokenizer:
    """The export's tokenizer: the benchmark has none (nothing is downloaded) and measures the weights."""

    def save_pretrained(self, folder) -> None:
        pass


# --------------------------------------------------------------------------- measurement


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _return_freed_heap() -> None:
    """glibc's ``malloc_trim``: what earlier phases freed below the mmap threshold goes back to the system before a
    phase, as train_model returns it before a checkpoint and the export (moeflow.train.peak_memory)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _file_backed_kib() -> int:
    """The resident set's file-backed pages (shared libraries, mapped files): clean, and as large as the files' page
    cache makes them, so left out of every figure (as moeflow.train.peak_memory leaves them out)."""
    return _status_kib("RssFile") + _status_kib("RssShmem")


def _write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise KeyError("write_bytes")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(barrier: Callable[[], None], phase: Callable[[], object]) -> tuple[object, dict]:
    """Run ``phase`` between two barriers; its peak RSS, start RSS, seconds, CPU seconds and bytes written on
    this rank."""
    gc.collect()
    _return_freed_heap()
    barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start_rss, written = (_status_kib("VmRSS") - _file_backed_kib()) * 1024, _write_bytes()
    started, cpu = time.perf_counter(), _cpu_seconds()
    result = phase()
    barrier()
    return result, {
        "peak_rss_bytes": (_status_kib("VmHWM") - _file_backed_kib()) * 1024,
        "start_rss_bytes": start_rss,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": _cpu_seconds() - cpu,
        "write_bytes": _write_bytes() - written,
    }


# --------------------------------------------------------------------------- the phases


def _load(model_dir: Path, parallel, ranks, weights: bool):
    D = distributed()
    kwargs = {} if weights else {"weights": False}
    return D.load_for_training(
        model_dir, model_section(), train_settings(), parallel, ranks, precision=precision(), **kwargs
    )


def _reads_weights_optional() -> bool:
    """Whether ``load_for_training`` can skip the base weights (the new design, for a checkpoint to fill)."""
    return "weights" in inspect.signature(distributed().load_for_training).parameters


def _trainer(model, world: int):
    if packages():
        from moeflow.data.collate import collate
        from moeflow.train.trainer import Trainer
    else:
        from moeflow.collate import collate

        from moeflow.train import Trainer

    return Trainer(
        model,
        train_settings(),
        two_document_rows(MICRO_BATCH * world, SEQ_LEN, VOCAB, cut=SEQ_LEN // 2),
        collate_fn=collate,
        seed=0,
        **({"precision": precision()} if METHOD != "full" else {}),
    )


def _with_optimizer_state(model, world: int):
    """A Trainer whose AdamW holds its moments, as after a first step: given by the step on zero gradients with
    which torch.distributed.checkpoint initialises a fresh optimizer (as moeflow.checkpoint.pieces.state_pieces
    does on resume; at learning rate 0 on torch 2.13, while torch 2.3's weight decay moves the weights a little,
    which changes no byte held), without a forward and backward pass (and FSDP's gathers and reductions) that
    would cost as much as the measured step."""
    from moeflow.checkpoint.pieces import init_optimizer_state

    trainer = _trainer(model, world)
    init_optimizer_state(trainer.optimizer)
    return trainer


def _resume(model_dir: Path, parallel, ranks, checkpoint: Path, weights: bool):
    """A fresh model and Trainer continuing from ``checkpoint``."""
    trainer = _trainer(_load(model_dir, parallel, ranks, weights), ranks.world_size)
    trainer.load(checkpoint)
    return trainer


def new_design() -> bool:
    """Whether the package streams the export from every rank (``moeflow.export``) rather than gathering the
    whole model into rank 0 (``distributed.whole_model``, the baseline)."""
    return packages() or importlib.util.find_spec("moeflow.export") is not None


def _export(model, folder: Path, max_shard_size: str, rank: int) -> str:
    """The final model, as the design's train_model.py writes it; which design it was."""
    if packages():
        from moeflow.checkpoint.export import save_final_model

        save_final_model(model, NoTokenizer(), folder, max_shard_size)
        return "moeflow.checkpoint.export.save_final_model"
    if new_design():
        from moeflow.export import save_final_model

        save_final_model(model, NoTokenizer(), folder, max_shard_size)
        return "moeflow.export.save_final_model"
    from moeflow.modeling import save_final_model as save_whole

    from moeflow import distributed as D

    whole = D.whole_model(model)  # a collective: the whole weights on rank 0
    if rank == 0:
        save_whole(whole, NoTokenizer(), folder)
    del whole
    return "distributed.whole_model + modeling.save_final_model"


def run(model_dir: Path, out: Path, strategy: str, max_shard_size: str, method: str = "full") -> None:
    global METHOD
    METHOD = method
    torch.set_num_threads(1)
    # what a train_model rank has loaded before its phases, its data's and its metrics log's libraries: the
    # planner's runtime counts them (moeflow.plan.memory.CPU_RANK_RUNTIME_BYTES)
    import datasets  # noqa: F401
    from torch.utils import tensorboard  # noqa: F401

    D = distributed()

    ranks = D.init("cpu")
    parallel = D.check_ranks(parallel_settings(strategy, ranks.world_size), ranks)
    world = ranks.world_size
    numbers: dict[str, dict] = {}
    model, numbers["load"] = measure(D.barrier, partial(_load, model_dir, parallel, ranks, weights=True))
    trainer = _with_optimizer_state(model, world)
    _, numbers["step"] = measure(D.barrier, trainer.train_step)
    checkpoint = out / "checkpoint" / "step-00000001"
    _, numbers["checkpoint"] = measure(D.barrier, partial(trainer.save, checkpoint))
    del trainer, model
    skip_weights = _reads_weights_optional()
    trainer, numbers["resume"] = measure(
        D.barrier, partial(_resume, model_dir, parallel, ranks, checkpoint, weights=not skip_weights)
    )
    export_design, numbers["export"] = measure(
        D.barrier, partial(_export, trainer.model, out / "model", max_shard_size, ranks.rank)
    )
    per_rank = D.gather_objects(numbers)
    if ranks.is_main:
        report = {
            "world": world,
            "strategy": strategy,
            "method": method,
            "design": "new" if new_design() else "old",
            "export": export_design,
            "resume_reads_base_weights": not skip_weights,
            "threads_per_rank": torch.get_num_threads(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "export_max_shard_size": max_shard_size,
            "parameters": json.loads((model_dir / "parameters.json").read_text())["parameters"],
            "ranks": per_rank,
        }
        (out / "phases.json").write_text(json.dumps(report, indent=1))
    D.teardown()


def build(model_dir: Path) -> None:
    """The benchmark model, saved once (HF-sharded) for every run on this stack."""
    if packages():
        from moeflow.loading.factory import make_model
        from moeflow.model.settings import ModelSettings
        from moeflow.settings import typed

        model = make_model(typed(ModelSettings, model_section()), vocab_size=VOCAB, seed=0)
    else:
        from moeflow.modeling import build_model

        model = build_model(model_section(), VOCAB, seed=0)
    # At the config's initializer_range (0.02) the attention's average over positions outweighs the embedding and
    # the routers send most tokens to a few experts: an expert no token reaches has no gradient and, on
    # transformers 4.57, no AdamW state. Unit-variance embeddings route every step's tokens to every expert.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir, safe_serialization=True, max_shard_size=SAVE_SHARD_SIZE)
    (model_dir / "parameters.json").write_text(json.dumps({"parameters": count}))
    print(f"benchmark model: {count / 1e6:.1f}M parameters in {model_dir}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("model_dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("model_dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--strategy", choices=("fsdp", "ep"), default="fsdp")
    r.add_argument("--export-shard-size", default="200MB")
    r.add_argument("--method", choices=tuple(METHODS), default="full")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.model_dir)
    else:
        run(args.model_dir, args.out, args.strategy, args.export_shard_size, args.method)


if __name__ == "__main__":
    main(sys.argv[1:])
