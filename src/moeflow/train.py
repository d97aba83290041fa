"""The training loop shared by pretrain_base, warmup and train_model.

One optimizer step: take the step's rows (a deterministic permutation per epoch), collate them into
micro-batches, count the step's label and routed tokens, optionally run the counting forward (balance
mode ``exact``), then per micro-batch: forward (``use_cache=False``, routing captured by hooks),
the micro-batch's share of the step loss (``moeflow.losses``), backward, and drop the graph. Then sum
gradients over ranks (``moeflow.distributed``: an all-reduce, or FSDP's reduce-scatter), clip, set the
learning rate (linear warmup, cosine to ``min_lr``), AdamW step, loss-free bias update, guards, logging
(TensorBoard + metrics.jsonl, rank 0), checkpoint.

Resumable checkpoints live in a folder keyed by the stage's settings, inputs and code, outside the
stage's declared outputs (``--rerun-incomplete`` deletes those); a run resumes from the newest complete
one and the folder is removed once the stage succeeds. Weights, optimizer state and RNG states are
safetensors; the step, data position, guard states and the metrics history are JSON. A run split at
any step (or killed and resumed) gives bit-identical losses on CPU with the same stack, threads and
precision.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from . import distributed as D
from . import guards as G
from .collate import MODEL_INPUTS
from .config import resolve_warmup_steps
from .files import atomic_dir, read_json, write_json
from .losses import LayerRouter, LossSettings, StepLoss, count_label_tokens, expert_counts, token_mask, update_correction_bias
from .stage import code_version, kill_point, progress

log = logging.getLogger("moeflow.train")

# A router's weight, also under peft: its frozen base_layer, or its own adapter (train.lora.router: adapter).
ROUTER_PARAM = re.compile(r"(^|\.)(gate|router)\.(base_layer\.|lora_[AB]\.[^.]+\.)?(weight|bias)$")
CHECKPOINT_DIR = re.compile(r"^step-(\d{8})$")
CHECKPOINT_FILES = ("trainer_state.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors")
# Measured, not computed: kept out of trainer_state.json so that a checkpoint's state is deterministic.
TIMING_KEYS = ("seconds", "tokens_per_s", "flops_per_s", "mfu", "memory_mib")


class TrainConfigError(ValueError):
    """A training setting that cannot work, naming the key and what to do."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TrainSettings:
    """The loop's settings (config sections ``train:`` and ``pretrain:``; see config/config.yaml)."""

    steps: int
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 2
    grad_accum_steps: int = 1
    gradient_checkpointing: bool = False
    router_lr_multiplier: float = 1.0
    freeze_router: bool = False
    loss: LossSettings = field(default_factory=LossSettings)
    routing_guard: G.RoutingThresholds = field(default_factory=G.RoutingThresholds)
    memory_guard: G.MemoryThresholds = field(default_factory=G.MemoryThresholds)
    log_every: int = 1
    eval_every: int = 0
    eval_max_sequences: int | None = None
    checkpoint_every: int = 0
    detect_anomaly: bool = False
    peak_flops_per_s: float | None = None

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> "TrainSettings":
        s = dict(section)
        simple = {k: s[k] for k in cls.__dataclass_fields__ if k in s and k not in ("loss", "routing_guard", "memory_guard", "betas")}
        simple["warmup_steps"] = resolve_warmup_steps(s)
        if simple["warmup_steps"] > s["steps"]:
            raise TrainConfigError(f"warmup_steps ({simple['warmup_steps']}) must not exceed steps ({s['steps']})")
        return cls(
            **simple,
            betas=tuple(s.get("betas", (0.9, 0.95))),
            loss=LossSettings.from_config(s.get("balance", {})),
            routing_guard=G.RoutingThresholds.from_config(s.get("routing_guard")),
            memory_guard=G.MemoryThresholds.from_config(s.get("memory_guard")),
        )

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (reaching the peak at the last warmup step), then cosine from
    the peak to ``min_ratio`` at ``total_steps``. The warmup part does not depend on ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress_ = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))


def param_groups(model: torch.nn.Module, settings: TrainSettings) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on norms and biases (1-D in the model, also when FSDP1 has flattened
    them), routers at ``router_lr_multiplier`` (or frozen with ``freeze_router``). Each group keeps its
    multiplier under ``lr_multiplier``."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        is_router = bool(ROUTER_PARAM.search(name))
        if is_router and settings.freeze_router:
            param.requires_grad_(False)
        if not param.requires_grad:
            continue
        groups.setdefault((is_router, len(D.original_shape(param)) >= 2), []).append(param)
    out = []
    for (is_router, decay), params in sorted(groups.items()):
        multiplier = settings.router_lr_multiplier if is_router else 1.0
        out.append(
            {
                "params": params,
                "weight_decay": settings.weight_decay if decay else 0.0,
                "lr": settings.lr * multiplier,
                "lr_multiplier": multiplier,
                "name": ("router" if is_router else "other") + ("" if decay else "_no_decay"),
            }
        )
    return out


def correction_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    """DeepSeek-V3-style expert correction biases (``e_score_correction_bias``), in layer order."""
    found = [(name, buf) for name, buf in model.named_buffers() if name.endswith("e_score_correction_bias")]
    found += [(name, p) for name, p in model.named_parameters() if name.endswith("e_score_correction_bias")]

    def layer_of(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name)
        return int(m.group(1)) if m else -1

    return [t for _, t in sorted(found, key=lambda nt: layer_of(nt[0]))]


# --------------------------------------------------------------------------- forward




def routed_forward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], routing=None, router_grad: bool = True):
    """One training forward (``use_cache=False``) and its MoE layers' routing restricted to the
    non-padding tokens. ``routing``: an open ``moeflow.routing.capture`` of the model, or None for a
    model without MoE layers. ``router_grad``: False when no loss term differentiates through the
    router (the statistics are then built without a graph). Keep the capture open through the backward
    pass: under non-reentrant checkpointing the recomputation must run the same router hooks as the
    forward did."""
    device = next(model.parameters()).device
    inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
    # Routing comes from the hooks: output_router_logits=True would make transformers 4.57 compute
    # its own aux loss, which raises on the 4D per-document mask.
    outputs = model(**inputs, use_cache=False)
    if routing is None:
        return outputs, []
    mask = token_mask(batch).reshape(-1).to(device)
    real = (lambda t: t) if bool(mask.all()) else (lambda t: t[mask])  # packed rows: padding only in a split's last row
    with contextlib.nullcontext() if router_grad else torch.no_grad():
        layers = [
            LayerRouter(logits=real(r.logits), probs=real(r.probs()), topk_index=real(r.topk_index).detach())
            for r in routing.layers
        ]
    return outputs, layers


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing (transformers 5's name for it where it exists)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()  # non-reentrant by default
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def collate_rows(rows: Sequence[Mapping[str, Any]], attn_implementation: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``moeflow.collate.collate`` with the 4D mask, where needed, in ``dtype`` (the model's)."""
    from .collate import collate

    return collate(rows, attn_implementation, dtype)


def routing_adapter(model: torch.nn.Module):
    """The routing adapter of an MoE model; None for a model without MoE layers."""
    from .routing import UnsupportedModel, adapter_for

    try:
        return adapter_for(model)
    except UnsupportedModel as exc:
        if "no MoE layer" in str(exc) or "dense model" in str(exc):
            return None
        raise


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    settings: LossSettings,
    adapter=None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepLoss:
    """Add one optimizer step's gradients to ``.grad`` (micro-batch by micro-batch); return its StepLoss."""
    from .routing import capture

    label_tokens = sum(count_label_tokens(b["labels"]) for b in micro_batches)
    routed_tokens = sum(int(token_mask(b).sum()) for b in micro_batches)
    with capture(model, adapter) if adapter is not None else contextlib.nullcontext() as routing:
        step_counts = None
        if settings.needs_counting_forward and routing is not None:
            with torch.no_grad():
                for batch in micro_batches:
                    with autocast():
                        _, layers = routed_forward(model, batch, routing, router_grad=False)
                    counts = expert_counts(layers)
                    step_counts = counts if step_counts is None else step_counts + counts
        step = StepLoss.for_step(settings, label_tokens, routed_tokens, len(micro_batches), step_counts)
        for batch in micro_batches:
            with autocast():
                outputs, layers = routed_forward(model, batch, routing, settings.needs_router_grad)
            loss = step.micro_batch_loss(outputs.logits, batch["labels"].to(outputs.logits.device), layers)
            loss.backward()
            del outputs, layers, loss
    return step


# --------------------------------------------------------------------------- data order


class DataOrder:
    """A deterministic permutation of the rows per epoch; the position is part of the checkpoint."""

    def __init__(self, num_rows: int, seed: int):
        if num_rows <= 0:
            raise TrainConfigError("the training split has no rows: check the data stage's manifest")
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.position = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            k = min(n - len(out), self.num_rows - self.position)
            out += self._perm[self.position : self.position + k]
            self.position += k
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise TrainConfigError(f"checkpoint data position is for {state['num_rows']} rows/seed {state['seed']}, not {self.num_rows}/{self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self._permutation(self.epoch)


# --------------------------------------------------------------------------- checkpoints


# Optimizer state in safetensors: "<parameter name>/<state key>" (names hold dots, never a slash).
OPTIM_KEY_SEPARATOR = "/"


def _flatten_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``moeflow.distributed.full_state_dict``'s optimizer state (keyed by parameter name) as safetensors
    tensors plus JSON (scalars and parameter groups)."""
    tensors, scalars = {}, {}
    for name, per_param in state["state"].items():
        for key, value in per_param.items():
            flat = f"{name}{OPTIM_KEY_SEPARATOR}{key}"
            if isinstance(value, torch.Tensor):
                tensors[flat] = value.detach().cpu().contiguous()
            else:
                scalars[flat] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, _, key = flat.rpartition(OPTIM_KEY_SEPARATOR)
        state.setdefault(name, {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _without_shared_memory(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the second and later ones."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return out


def fingerprint_paths(paths: Sequence[str | os.PathLike]) -> list[Any]:
    """Identify input files/folders cheaply: relative names, sizes and modification times."""
    out = []
    for path in sorted(map(str, paths)):
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        out.append([path, [[f.relative_to(p).as_posix() if p.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.exists()]])
    return out


def checkpoint_key(settings: Mapping[str, Any], inputs: Sequence[str | os.PathLike]) -> str:
    """The resume key: a hash of the stage's settings, its inputs and the moeflow code."""
    from .config import stable_hash

    return stable_hash({"settings": settings, "inputs": fingerprint_paths(inputs), "code": code_version()}, 16)


# --------------------------------------------------------------------------- logging


class MetricsLog:
    """metrics.jsonl plus TensorBoard event files (scalars, and per-layer expert-load histograms)."""

    def __init__(self, log_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(log_dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "w", encoding="utf-8")
        self.writer = SummaryWriter(str(self.dir / "tensorboard"))

    def write(self, record: Mapping[str, Any]) -> None:
        import json

        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.jsonl.flush()
        step = int(record["step"])
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)
        for layer, health in enumerate(record.get("routing", [])):
            for key in ("max_over_mean", "cv", "load_entropy", "router_entropy"):
                if key in health:
                    self.writer.add_scalar(f"routing/layer{layer}/{key}", health[key], step)
            self.writer.add_scalar(f"routing/layer{layer}/dead_experts", len(health["dead_experts"]), step)
            load = health["load"]
            total = sum(load)
            if total:
                self.writer.add_histogram_raw(
                    f"routing/layer{layer}/expert_load",
                    min=0, max=len(load) - 1, num=total,
                    sum=sum(i * c for i, c in enumerate(load)),
                    sum_squares=sum(i * i * c for i, c in enumerate(load)),
                    bucket_limits=[i + 0.5 for i in range(len(load))],
                    bucket_counts=load,
                    global_step=step,
                )
        self.writer.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.writer.close()


def memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """The loop. ``rows``: any sequence of packed rows (a datasets.Dataset or a list of dicts).

    ``model``: as ``moeflow.distributed`` laid it out (whole, FSDP-wrapped, or sharded by transformers).
    With several ranks, each takes its share of the step's rows (``micro_batch_size x grad_accum_steps``
    per rank), the losses are normalised by the step's global counts, and the ranks' gradients are summed;
    checkpoints hold the whole state in one format for every layout, and every rank takes part in saving
    and loading them (rank 0 writes)."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: TrainSettings,
        rows: Sequence[Mapping[str, Any]],
        *,
        collate_fn: Callable[[list], dict],
        seed: int,
        precision: str = "fp32",
        stage: str = "train",
        eval_rows: Sequence[Mapping[str, Any]] | None = None,
        log_dir: str | os.PathLike | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        step_hook: Callable[[int, torch.nn.Module], None] | None = None,
    ):
        if precision not in ("fp32", "bf16"):
            raise TrainConfigError(f"config key 'precision': {precision!r}; use fp32 or bf16")
        self.model, self.settings, self.rows = model, settings, rows
        self.collate_fn, self.seed, self.precision, self.stage = collate_fn, seed, precision, stage
        self.eval_rows, self.step_hook = eval_rows, step_hook
        self.device = next(model.parameters()).device
        self.log_dir = Path(log_dir) if log_dir else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.rank, self.world = D.rank(), D.world_size()
        inner = D.unwrap(model)
        inner.config.use_cache = False
        if settings.gradient_checkpointing:
            enable_checkpointing(inner)
        model.train()
        self.adapter = routing_adapter(inner)
        self.optimizer = torch.optim.AdamW(param_groups(model, settings), lr=settings.lr, betas=settings.betas, eps=settings.eps)
        self.biases = correction_biases(model)
        self.order = DataOrder(len(rows), seed)
        # Dropout (LoRA's too) draws from the global generator: seeded here, its state saved in checkpoints,
        # so a fresh start and a resume (which loads that state) are both reproducible.
        torch.manual_seed(seed)
        self.routing_guard = G.RoutingGuard(settings.routing_guard)
        self.memory_guard = G.MemoryGuard(settings.memory_guard)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.flops_per_token = 6 * active_parameters(model)

    # ---- state

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data": self.order.state_dict(),
            "routing_guard": self.routing_guard.state_dict(),
            "history": [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in self.history],
        }

    def save(self, path: str | os.PathLike, extra_json: Mapping[str, Any] | None = None) -> None:
        """A full checkpoint at ``path``, written atomically by rank 0: weights, optimizer state (whole
        tensors by parameter name) and every rank's RNG states (safetensors); step, data position, guard
        state and metrics (JSON); plus ``extra_json`` ({file name: object}). A collective: every rank
        calls it, and returns once the checkpoint is complete."""
        from safetensors.torch import save_file

        weights, optimizer = D.full_state_dict(self.model, self.optimizer, rank0_only=True)
        rng = D.gather_objects(self._rng_state())
        if self.rank == 0:
            tensors, meta = _flatten_optimizer(optimizer)
            with atomic_dir(path) as folder:
                save_file(_without_shared_memory(weights), str(folder / "model.safetensors"))
                save_file(tensors, str(folder / "optimizer.safetensors"))
                save_file({f"rank{r}.{k}": v for r, states in enumerate(rng) for k, v in states.items()}, str(folder / "rng.safetensors"))
                write_json(folder / "trainer_state.json", {**self.state(), "optimizer": meta})
                write_json(folder / "timings.json", [{k: r[k] for k in TIMING_KEYS if k in r} for r in self.history])
                for name, obj in (extra_json or {}).items():
                    write_json(folder / name, obj)
        D.barrier()

    def _rng_state(self) -> dict[str, torch.Tensor]:
        states = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def load(self, path: str | os.PathLike) -> None:
        """Continue from a full checkpoint (a resumable one, or the warmup stage's output). Every rank
        reads it and keeps its own shards; call it before the first step."""
        from safetensors.torch import load_file

        path = Path(path)
        missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"checkpoint {path} lacks {', '.join(missing)}: moeflow reads checkpoints as safetensors plus JSON only "
                "(pickle files are never loaded: unpickling can run code). Delete the folder to start the stage afresh"
            )
        state = read_json(path / "trainer_state.json")
        optimizer = _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
        D.load_full_state_dict(self.model, load_file(str(path / "model.safetensors")), self.optimizer, optimizer)
        rng = load_file(str(path / "rng.safetensors"))
        mine = f"rank{self.rank}" if f"rank{self.rank}.torch" in rng else "rank0"
        torch.set_rng_state(rng[f"{mine}.torch"])
        if self.device.type == "cuda" and f"{mine}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"{mine}.cuda"], self.device)
        self.step = int(state["step"])
        self.order.load_state_dict(state["data"])
        self.routing_guard.load_state_dict(state["routing_guard"])
        timings = read_json(path / "timings.json") if (path / "timings.json").is_file() else []
        self.history = [{**r, **t} for r, t in zip(state["history"], timings)] if timings else list(state["history"])
        log.info("%s: continuing from %s at step %d", self.stage, path, self.step)

    def resume(self) -> bool:
        """Load the newest complete resumable checkpoint, if any (the folder's name is the key)."""
        latest = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if latest is None:
            return False
        self.load(latest)
        return True

    def _checkpoint(self) -> None:
        if self.checkpoint_dir is None:
            return
        self.save(self.checkpoint_dir / f"step-{self.step:08d}")
        if self.rank != 0:
            return
        for old in sorted(self.checkpoint_dir.iterdir()):
            if CHECKPOINT_DIR.match(old.name) and old.name != f"step-{self.step:08d}":
                shutil.rmtree(old, ignore_errors=True)

    def remove_checkpoints(self) -> None:
        """Once the stage has succeeded: the resumable checkpoints are no longer needed."""
        if self.checkpoint_dir is not None and self.rank == 0:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    # ---- the loop

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def micro_batches(self) -> list[dict]:
        s = self.settings
        per_rank = s.rows_per_step
        indices = self.order.take(per_rank * self.world)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [self.collate_fn([self.rows[i] for i in indices[j : j + s.micro_batch_size]]) for j in range(0, per_rank, s.micro_batch_size)]

    def step_gradients(self) -> dict[str, Any]:
        """The next step's forward and backward on this rank's micro-batches, then the gradients summed over
        ranks (every rank holds the step's gradient, or its shards of it); return the step's loss summary
        (global, the same on every rank). ``train_step`` without the update: tests compare it across layouts."""
        batches = self.micro_batches()
        with torch.autograd.set_detect_anomaly(self.settings.detect_anomaly):
            step_loss = accumulate_gradients(self.model, batches, self.settings.loss, self.adapter, self.autocast)
        del batches
        summary = step_loss.summary()
        D.reduce_gradients(self.model)
        return summary

    def train_step(self) -> dict[str, Any]:
        s = self.settings
        started = time.perf_counter()
        factor = lr_factor(self.step, s.warmup_steps, s.steps, s.min_lr / s.lr if s.lr else 0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = s.lr * group["lr_multiplier"] * factor
        summary = self.step_gradients()
        grad_norm = D.clip_grad_norm(self.model, s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
        loss = summary["ce"] + s.loss.balance_coef * summary["balance"] + s.loss.z_loss_coef * summary["z_loss"]
        G.check_finite({"loss": loss, "grad_norm": grad_norm}, self.step + 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts = torch.tensor(summary.get("counts", []), dtype=torch.float64)
        update_correction_bias(self.biases, counts, s.loss.bias_update_rate)
        self.step += 1
        seconds = time.perf_counter() - started
        flops_per_s = self.flops_per_token * summary["routed_tokens"] / seconds  # all ranks together
        entropy = summary.get("router_entropy", [])
        record = {
            "kind": "train",
            "step": self.step,
            "lr": s.lr * factor,
            "loss": loss,
            "ce": summary["ce"],
            "balance_loss": summary["balance"],
            "balance_global": summary.get("balance_global", 0.0),
            "z_loss": summary["z_loss"],
            "grad_norm": grad_norm,
            "tokens": summary["routed_tokens"],
            "label_tokens": summary["label_tokens"],
            "seconds": seconds,
            "tokens_per_s": summary["routed_tokens"] / seconds,
            "flops_per_s": flops_per_s,
            # model-FLOP utilisation per device against train.peak_flops_per_s (None when unknown)
            "mfu": flops_per_s / (s.peak_flops_per_s * self.world) if s.peak_flops_per_s else None,
            "memory_mib": memory_mib(self.device),
            "routing": [G.layer_health(load, e) for load, e in zip(summary.get("counts", []), entropy)],
        }
        record["alarms"] = self.routing_guard.observe(self.step, summary.get("counts", []), entropy, summary["ce"])
        return record

    def evaluate(self) -> dict[str, Any]:
        from .evaluate import batches, evaluate_batches

        attn = getattr(D.unwrap(self.model).config, "_attn_implementation", "sdpa")
        stats = evaluate_batches(
            self.model,
            batches(self.eval_rows, self.settings.micro_batch_size, attn, self.settings.eval_max_sequences),
            self.adapter,
            self.precision,
        )
        self.model.train()
        return {"kind": "eval", "step": self.step, "loss": stats.loss, "perplexity": stats.perplexity, "label_tokens": stats.label_tokens}

    def _evaluation_due(self) -> bool:
        s = self.settings
        return self.eval_rows is not None and self.step > 0 and ((s.eval_every and self.step % s.eval_every == 0) or self.step == s.steps)

    def _evaluate_and_log(self, metrics: MetricsLog | None) -> None:
        evaluation = self.evaluate()
        self.history.append(evaluation)
        if metrics:
            metrics.write(evaluation)
        log.info("%s step %d: eval loss %.4f", self.stage, self.step, evaluation["loss"])

    def run(self, until: int | None = None) -> dict[str, Any]:
        """Train until step ``until`` (default: ``settings.steps``); return the last train record."""
        s = self.settings
        until = s.steps if until is None else until
        metrics = MetricsLog(self.log_dir) if self.log_dir and self.rank == 0 else None
        try:
            for record in self.history:  # a resumed run's log starts with the steps already done
                if metrics:
                    metrics.write(record)
            if self._evaluation_due() and not any(r["kind"] == "eval" and r["step"] == self.step for r in self.history):
                self._evaluate_and_log(metrics)  # continuing from a stage that ended on an evaluation step
            for _ in progress(range(self.step, until), total=until - self.step, desc=f"{self.stage} steps"):
                record = self.train_step()
                self.history.append(record)
                if self.step_hook is not None:
                    self.step_hook(self.step, self.model)
                self.memory_guard.observe(self.step, record["memory_mib"])
                if metrics and (self.step % max(1, s.log_every) == 0 or self.step == until):
                    metrics.write(record)
                if self._evaluation_due():
                    self._evaluate_and_log(metrics)
                if s.log_every and self.step % s.log_every == 0:
                    log.info("%s step %d/%d: loss %.4f ce %.4f balance %.4f lr %.3g grad %.3f %.0f tok/s",
                             self.stage, self.step, until, record["loss"], record["ce"], record["balance_loss"], record["lr"], record["grad_norm"], record["tokens_per_s"])
                if s.checkpoint_every and self.step % s.checkpoint_every == 0 and self.step < until:
                    self._checkpoint()
                kill_point(f"{self.stage}.step{self.step}")
        finally:
            if metrics:
                metrics.close()
        return next((r for r in reversed(self.history) if r["kind"] == "train"), {})

    def train_records(self) -> list[dict[str, Any]]:
        return [r for r in self.history if r["kind"] == "train"]


def latest_checkpoint(folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    steps = sorted(p for p in folder.iterdir() if CHECKPOINT_DIR.match(p.name) and (p / "trainer_state.json").is_file())
    return steps[-1] if steps else None


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token passes through: everything but the experts a token does not use (whole
    parameters, also of a sharded model)."""
    config = D.unwrap(model).config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    sizes = {n: math.prod(D.original_shape(p)) for n, p in model.named_parameters()}
    total = sum(sizes.values())
    if not experts or not top_k:
        return total
    expert_params = sum(k for n, k in sizes.items() if ".experts." in n or n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj"))
    return int(total - expert_params + expert_params * top_k / experts)


# --------------------------------------------------------------------------- stage entry points


class _Named(dict):
    """Snakemake-style access to a job's named inputs, outputs and params: ``job.input.model``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def job_from_argv(argv: Sequence[str] | None = None) -> Any:
    """The ``snakemake`` object of a training script that a ``shell:`` rule starts through torchrun.

    The rule passes ``--job`` (JSON: rule, input, output, params), ``--threads`` and ``--log-file``; the
    result has the attributes ``Stage.from_snakemake`` and the scripts read, as a ``script:`` rule's has.
    Under torchrun the rule's threads are shared by the node's ranks (``threads // LOCAL_WORLD_SIZE``), and
    only rank 0 writes the log file (the other ranks log to stderr).
    """
    parser = argparse.ArgumentParser(description="a moeflow training stage (started by its Snakemake rule)")
    parser.add_argument("--job", required=True, help="JSON with rule, input, output and params")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args(argv)
    job = json.loads(args.job)
    return argparse.Namespace(
        rule=job["rule"],
        input=_Named(job["input"]),
        output=_Named(job["output"]),
        params=_Named(job["params"]),
        log=[args.log_file] if args.log_file and int(os.environ.get("RANK", "0")) == 0 else [],
        threads=max(1, args.threads // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
    )


def load_for_training(
    path: str | os.PathLike, model_cfg: Mapping[str, Any], train: Mapping[str, Any], parallel: D.Parallel, ranks: D.Ranks,
    data: str | os.PathLike | None = None,
) -> torch.nn.Module:
    """A saved model folder, ready for the Trainer: loaded for the layout (``moeflow.distributed.load_model``),
    checked against the vocabulary ``data`` (a tokenized split folder) was tokenized with (``moeflow.modeling.check_vocabulary``), with LoRA adapters for ``train.method: lora`` (:func:`prepare_model`), then sharded (``shard_model``:
    before the optimizer is built). LoRA runs on several ranks with ``parallel.strategy: none`` only."""
    if train.get("method", "full") == "lora" and parallel.strategy != "none" and ranks.world_size > 1:
        raise D.DistributedError(
            f"config keys 'train.method': lora and 'parallel.strategy': {parallel.strategy} do not combine: LoRA adapters are "
            "not sharded here (peft over FSDP or expert parallelism is not built). Use parallel.strategy: none (every rank "
            "holds the frozen base model and the adapters; the adapters' gradients are summed over ranks), or train.method: full"
        )
    from .modeling import check_vocabulary

    model = D.load_model(path, model_cfg, parallel)
    if data is not None:
        check_vocabulary(model, [data], path)
    return D.shard_model(prepare_model(model, train), parallel, ranks)


def prepare_model(model: torch.nn.Module, train: Mapping[str, Any]) -> torch.nn.Module:
    """The model the loop trains: the model itself (``train.method: full``), or wrapped with LoRA
    adapters (``lora``: moeflow.lora, the base weights frozen)."""
    if train.get("method", "full") == "lora":
        from .lora import apply_lora

        return apply_lora(model, train.get("lora"), bool(train.get("gradient_checkpointing", False)))
    return model


def save_final_model(model: torch.nn.Module, tokenizer: Any, folder: str | os.PathLike) -> None:
    """A folder that AutoModelForCausalLM/AutoTokenizer.from_pretrained load (LoRA adapters merged in); atomic."""
    from .lora import is_lora_model, merge_and_save

    if is_lora_model(model):
        model.config.use_cache = True
        merge_and_save(model, tokenizer, folder)
        return
    with atomic_dir(folder) as out:
        write_model_folder(model, tokenizer, out)


def write_model_folder(model: torch.nn.Module, tokenizer: Any, folder: str | os.PathLike) -> None:
    """save_pretrained (safetensors) of the model and its tokenizer into an existing folder."""
    model.config.use_cache = True  # a saved model generates with a cache; training turned it off
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def train_stage(
    stage: Any,
    model: torch.nn.Module,
    settings: TrainSettings,
    rows: Sequence[Mapping[str, Any]],
    *,
    attn_implementation: str,
    log_dir: str | os.PathLike | None,
    checkpoint_root: str | os.PathLike,
    key_settings: Mapping[str, Any],
    key_inputs: Sequence[str | os.PathLike],
    start_from: str | os.PathLike | None = None,
    until: int | None = None,
    eval_rows: Sequence[Mapping[str, Any]] | None = None,
) -> Trainer:
    """Run one training stage: resume from its keyed checkpoint folder if one matches, else start
    (from ``start_from``, a full checkpoint, if given), train until ``until``. The caller writes its
    outputs, then calls ``trainer.remove_checkpoints()``."""
    runtime = [stage.precision, stage.seed, stage.threads, D.world_size()]
    key = checkpoint_key({"stage": stage.name, "settings": key_settings, "runtime": runtime}, key_inputs)
    dtype = next(model.parameters()).dtype
    trainer = Trainer(
        model,
        settings,
        rows,
        collate_fn=lambda batch_rows: collate_rows(batch_rows, attn_implementation, dtype),
        seed=stage.seed,
        precision=stage.precision,
        stage=stage.name,
        eval_rows=eval_rows,
        log_dir=log_dir,
        checkpoint_dir=Path(checkpoint_root) / f"{stage.name}-{key}",
    )
    if not trainer.resume() and start_from is not None:
        trainer.load(start_from)
    trainer.run(until)
    return trainer
