"""The training loop shared by pretrain_base, warmup and train_model.

One optimizer step: take the step's rows (a deterministic permutation per epoch), collate them into
micro-batches, count the step's label and routed tokens, optionally run the counting forward (balance
mode ``exact``), then per micro-batch: forward (``use_cache=False``, routing captured by hooks),
the micro-batch's share of the step loss (``moeflow.train.losses``; with ``train.mtp.mode: train`` the MTP
loss too, from the decoder's last hidden state: ``moeflow.model.mtp_loss``), backward, and drop the graph. Then sum
gradients over ranks (``moeflow.parallel.gradients``: an all-reduce, or FSDP's reduce-scatter), clip, set the
learning rate (linear warmup, cosine to ``min_lr``), optimizer step (AdamW, or Muon with AdamW:
``moeflow.train.optimizers``), loss-free bias update, guards, logging
(TensorBoard + metrics.jsonl, rank 0), checkpoint.

Resumable checkpoints live in a folder keyed by the stage's settings, inputs and code, outside the
stage's declared outputs (``--rerun-incomplete`` deletes those); a run resumes from the newest complete
one and the folder is removed once the stage succeeds. Weights, optimizer state and RNG states are
safetensors (each rank writes its shards through torch.distributed.checkpoint); the step, data position,
guard states and the metrics history are JSON. A run split at
any step (or killed and resumed) gives bit-identical losses on CPU with the same stack, threads and
precision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moeflow.checkpoint import state as C
from moeflow.data.collate import collate, model_inputs, token_mask
from moeflow.data.order import DataOrder
from moeflow.evaluation.loop import SetStats, batches, evaluate_batches, sum_stats
from moeflow.evaluation.routing_stats import layer_health
from moeflow.families.mtp import unfreeze_mtp_layers
from moeflow.model.activation_checkpointing import enable_activation_checkpointing
from moeflow.model.chunked_loss import count_label_tokens, decoder_forward, token_losses
from moeflow.model.mtp_loss import mtp_sums
from moeflow.model.routing import adapter_or_none, capture
from moeflow.model.wrappers import unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.gradients import clip_grad_norm, fill_missing_gradients, reduce_gradients, release_gradients
from moeflow.parallel.layouts import reshard
from moeflow.parallel.process_group import all_reduce_sum, gather_objects, rank, world_size
from moeflow.runtime.host_copies import model_device, to_device
from moeflow.runtime.stage import kill_point, progress
from moeflow.settings import PRECISIONS, enum
from moeflow.train import guards as G
from moeflow.train.expert_mask import masked_training
from moeflow.train.losses import (
    LayerRouter,
    StepLoss,
    expert_counts,
    real_token_positions,
    update_correction_bias,
)
from moeflow.train.metrics import MetricsLog, flop_bearing_parameters
from moeflow.train.optimizers import build_optimizer
from moeflow.train.param_groups import correction_biases, lr_factor, param_groups, set_learning_rate
from moeflow.train.peak_memory import PhasePeaks, release_freed_memory
from moeflow.train.settings import BalanceSettings, MtpSettings, TrainSettings

log = logging.getLogger("moeflow.train.trainer")


class TrainConfigError(ValueError):
    """A training setting that cannot work, naming the key and what to do."""


def routed_forward(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    routing=None,
    router_grad: bool = True,
    loss: bool = True,
    keep_hidden: bool = False,
):
    """One training forward (``use_cache=False``) with its summed cross-entropy on the batch's labels
    (``moeflow.model.chunked_loss.TokenLosses``: the full logits are never built) and its MoE layers' routing
    restricted to the non-padding tokens. ``routing``: an open ``moeflow.model.routing.capture`` of the model, or
    None for a
    model without MoE layers. ``router_grad``: False when no loss term differentiates through the
    router (the statistics are then built without a graph). Keep the capture open through the backward
    pass: under non-reentrant checkpointing the recomputation must run the same router hooks as the
    forward did. ``loss=False``: the decoder body alone, no output layer and no loss (outputs None), for a
    pass that only counts the routing. ``keep_hidden``: the outputs hold the decoder's last hidden state (for
    the MTP loss)."""
    device = model_device(model)
    inputs = model_inputs(model, batch)
    # Routing comes from the hooks: output_router_logits=True would make transformers 4.57 compute
    # its own aux loss, which raises on the 4D per-document mask.
    outputs = token_losses(model, inputs, batch["labels"], keep_hidden) if loss else None
    if not loss:
        decoder_forward(model, inputs)
    if routing is None:
        return outputs, []
    positions = real_token_positions(batch)  # None for packed rows: padding only in a split's last row
    if positions is not None:
        positions = to_device(positions, device)  # pinned, non-blocking from the host

    def real(t: torch.Tensor) -> torch.Tensor:
        return t if positions is None else t.index_select(0, positions)

    with contextlib.nullcontext() if router_grad else torch.no_grad():
        layers = [
            LayerRouter(logits=real(r.logits), probs=real(r.probs()), topk_index=real(r.topk_index).detach())
            for r in routing.layers
        ]
    return outputs, layers


def train_mtp_layers(model: torch.nn.Module) -> None:
    """``train.mtp.mode: train``: the MTP layers train (moeflow.families.mtp.unfreeze_mtp_layers; the factory
    did it already for a model built for training), so that param_groups puts them in the optimizer's groups,
    with weight decay as the main layers' alike; a model without MTP layers is refused."""
    if not unfreeze_mtp_layers(model):
        raise TrainConfigError(
            f"config key 'train.mtp.mode': train, but the model ({unwrap(model).config.model_type}) has no MTP "
            "layers (num_nextn_predict_layers); set train.mtp.mode: frozen"
        )


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    settings: BalanceSettings,
    adapter=None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    mtp: MtpSettings | None = None,
) -> StepLoss:
    """Add one optimizer step's gradients to ``.grad`` (micro-batch by micro-batch); return its StepLoss.
    ``mtp``: the MTP layers train (their loss joins the step's), or None."""
    label_tokens = sum(count_label_tokens(b["labels"]) for b in micro_batches)
    routed_tokens = sum(int(token_mask(b).sum()) for b in micro_batches)
    with capture(model, adapter) if adapter is not None else contextlib.nullcontext() as routing:
        step_counts = None
        if settings.needs_counting_forward and routing is None:
            step_counts = expert_counts([])  # a dense model: no MoE layer to count, no balancing loss
        elif settings.needs_counting_forward:
            with torch.no_grad():
                for batch in micro_batches:
                    with autocast():
                        _, layers = routed_forward(model, batch, routing, router_grad=False, loss=False)
                    counts = expert_counts(layers)
                    step_counts = counts if step_counts is None else step_counts + counts
        weight = mtp.loss_weight if mtp is not None else 0.0
        step = StepLoss.for_step(settings, label_tokens, routed_tokens, len(micro_batches), step_counts, weight)
        for batch in micro_batches:
            with autocast():
                keep = mtp is not None
                outputs, layers = routed_forward(model, batch, routing, settings.needs_router_grad, keep_hidden=keep)
                depths = mtp_sums(model, outputs, batch) if mtp is not None else ()
            loss = step.micro_batch_loss(outputs.loss, layers, depths)
            loss.backward()
            del outputs, layers, loss, depths
    return step


class Trainer:
    """The loop. ``rows``: any sequence of packed rows (a datasets.Dataset or a list of dicts).

    ``model``: as ``moeflow.loading.factory`` laid it out (whole, FSDP-wrapped, or sharded by transformers).
    With several ranks, each takes its share of the step's rows (``micro_batch_size x grad_accum_steps``
    per rank), the losses are normalised by the step's global counts, and the ranks' gradients are summed;
    every rank saves and loads its own shards of the checkpoints (``moeflow.checkpoint.state``), which load into
    any layout and world size."""

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
        expert_selection: Mapping[str, Any] | None = None,
        peaks: PhasePeaks | None = None,
    ):
        if precision not in enum(PRECISIONS):
            raise TrainConfigError(f"config key 'precision': {precision!r}; use one of {', '.join(enum(PRECISIONS))}")
        self.model, self.settings, self.rows = model, settings, rows
        self.collate_fn, self.seed, self.precision, self.stage = collate_fn, seed, precision, stage
        self.eval_rows, self.step_hook = eval_rows, step_hook
        self.device = model_device(model)
        # each phase's peak on this rank (step, checkpoint, resume), beside the memory plan's in the report card
        self.peaks = peaks or PhasePeaks(self.device)
        self.log_dir = Path(log_dir) if log_dir else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.rank, self.world = rank(), world_size()
        inner = unwrap(model)
        inner.config.use_cache = False
        if settings.gradient_checkpointing:
            enable_activation_checkpointing(inner)
        model.train()
        self.adapter = adapter_or_none(inner)
        # The optimizer holds the shards: after a forward without backward (a base reference, an evaluation)
        # FSDP2 leaves the root unit's gathered parameters registered, which no backward would ever update.
        reshard(model)
        if settings.trained_mtp is not None:
            train_mtp_layers(model)
        # train.method esft: only the selected experts train (moeflow.train.expert_mask); None for other methods
        self.expert_mask = masked_training(model, settings, expert_selection)
        groups = param_groups(model, settings)
        if self.expert_mask is not None:
            groups = self.expert_mask.param_groups(groups)
        # no learning rate yet: train_step sets each group's (param_groups.set_learning_rate) before its update
        self.optimizer = build_optimizer(model, settings, groups)
        self.biases = correction_biases(model)
        self.order = DataOrder(len(rows), seed, settings.order)
        # Dropout (LoRA's too) draws from the global generator: seeded here, its state saved in checkpoints,
        # so a fresh start and a resume (which loads that state) are both reproducible.
        torch.manual_seed(seed)
        self.routing_guard = G.RoutingGuard(settings.routing_guard)
        self.memory_guard = G.MemoryGuard(settings.memory_guard)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        # the MFU's: no embedding lookup; the MTP layers when they train
        self.flops_per_token = 6 * flop_bearing_parameters(model, mtp_trains=settings.trained_mtp is not None)

    # ---- state

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data": self.order.state_dict(),
            "routing_guard": self.routing_guard.state_dict(),
            "history": C.without_timings(self.history),
        }

    def save(self, path: str | os.PathLike, extra_json: Mapping[str, Any] | None = None) -> None:
        """A full checkpoint at ``path`` (``moeflow.checkpoint.state.save_checkpoint``), plus ``extra_json``
        ({file name: object}). A collective: every rank calls it and writes its shards; it returns once the
        checkpoint is complete under its final name."""
        release_freed_memory()  # the step's freed activations: not resident through the save
        with self.peaks.measure("checkpoint"):
            C.save_checkpoint(path, self.model, self.optimizer, self.state(), self.history, extra_json)

    def load(self, path: str | os.PathLike) -> None:
        """Continue from a full checkpoint (a resumable one, or the warmup stage's output), saved by any
        world size and layout. Every rank reads only its own shards; call it before the first step."""
        with self.peaks.measure("resume"):
            state = C.load_checkpoint(path, self.model, self.optimizer)
        self.step = int(state["step"])
        self.order.load_state_dict(state["data"])
        self.routing_guard.load_state_dict(state["routing_guard"])
        self.history = state["history"]
        log.info("%s: continuing from %s at step %d", self.stage, path, self.step)

    def resume(self) -> bool:
        """Load the newest complete resumable checkpoint, if any (the folder's name is the key): rank 0's
        choice, on every rank (``moeflow.checkpoint.state.resume_point``)."""
        latest = C.resume_point(self.checkpoint_dir) if self.checkpoint_dir else None
        if latest is None:
            return False
        self.load(latest)
        return True

    def _checkpoint(self) -> None:
        if self.checkpoint_dir is None:
            return
        path = C.step_folder(self.checkpoint_dir, self.step)
        self.save(path)
        if self.rank == 0:
            C.remove_other_checkpoints(self.checkpoint_dir, path)

    def optimizer_state_bytes(self) -> int:
        """The bytes the optimizer's state holds, summed over the ranks (each holds its shards): what a training
        method costs beyond the weights (AdamW: two moments per parameter it updates). A collective where the
        ranks are several; call it after a step (AdamW creates its state at the first one)."""
        held = sum(
            dtensors.local_tensor(t).nbytes
            for state in self.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        )
        return int(all_reduce_sum(torch.tensor([held], dtype=torch.int64, device=self.device)).item())

    def free_optimizer(self) -> None:
        """Drop AdamW's states (two fp32 tensors per parameter, on the device) once the last step is taken and
        checkpointed: the export that follows gathers the weights into the room they held."""
        self.optimizer.state.clear()
        import gc

        gc.collect()
        release_freed_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
        return [
            self.collate_fn([self.rows[i] for i in indices[j : j + s.micro_batch_size]])
            for j in range(0, per_rank, s.micro_batch_size)
        ]

    def step_gradients(self) -> dict[str, Any]:
        """The next step's forward and backward on this rank's micro-batches, then the gradients summed over
        ranks (every rank holds the step's gradient, or its shards of it; zero for a parameter the step did not
        reach: moeflow.parallel.gradients.fill_missing_gradients); return the step's loss summary
        (global, the same on every rank). ``train_step`` without the update: tests compare it across layouts."""
        batches = self.micro_batches()
        with torch.autograd.set_detect_anomaly(self.settings.detect_anomaly):
            step_loss = accumulate_gradients(
                self.model, batches, self.settings.balance, self.adapter, self.autocast, self.settings.trained_mtp
            )
        del batches
        summary = step_loss.summary()
        reduce_gradients(self.model)
        fill_missing_gradients(self.model)  # every parameter steps, in every layout (an expert no token reached too)
        return summary

    def train_step(self) -> dict[str, Any]:
        s = self.settings
        started = time.perf_counter()
        with self.peaks.measure("step"):
            factor = lr_factor(self.step, s.warmup_steps, s.steps, s.min_lr / s.lr if s.lr else 0.0)
            set_learning_rate(self.optimizer, s.lr, factor)
            summary = self.step_gradients()
            if self.expert_mask is not None:  # before clipping: the unselected rows' gradients count in no norm
                self.expert_mask.before_step(self.optimizer)
            grad_norm = clip_grad_norm(self.model, s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
            loss = summary["loss"]
            G.check_finite({"loss": loss, "grad_norm": grad_norm}, self.step + 1)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            release_gradients(self.model)
        counts = torch.tensor(summary.get("counts", []), dtype=torch.float64)
        update_correction_bias(self.biases, counts, s.balance.bias_update_rate)
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
            **({"mtp_loss": summary["mtp"]} if s.trained_mtp is not None else {}),
            "grad_norm": grad_norm,
            "tokens": summary["routed_tokens"],
            "label_tokens": summary["label_tokens"],
            "seconds": seconds,
            "tokens_per_s": summary["routed_tokens"] / seconds,
            "flops_per_s": flops_per_s,
            # model-FLOP utilisation per device against train.peak_flops_per_s (None when unknown)
            "mfu": flops_per_s / (s.peak_flops_per_s * self.world) if s.peak_flops_per_s else None,
            "memory_mib": self.peaks.last / 2**20,  # the step's peak (moeflow.train.peak_memory)
            "routing": [layer_health(load, e) for load, e in zip(summary.get("counts", []), entropy)],
        }
        record["alarms"] = self.routing_guard.observe(self.step, summary.get("counts", []), entropy, summary["ce"])
        return record

    def evaluation_stats(self) -> SetStats:
        """The validation rows' sums for the whole set, on every rank: each rank evaluates its share of the
        batches (``moeflow.evaluation.loop.batches``), then the ranks' sums are gathered and added up."""
        attn = unwrap(self.model).config._attn_implementation
        s = self.settings
        shard = batches(self.eval_rows, s.micro_batch_size, attn, s.eval_max_sequences, self.rank, self.world)
        mtp = (
            (lambda out, batch: float(torch.stack(mtp_sums(self.model, out, batch)).mean())) if s.trained_mtp else None
        )
        stats = evaluate_batches(self.model, shard, self.adapter, self.precision, mtp)
        reshard(self.model)  # FSDP2 keeps the root unit gathered after a forward without backward
        self.model.train()
        return sum_stats(gather_objects(stats))

    def evaluate(self) -> dict[str, Any]:
        stats = self.evaluation_stats()
        return {
            "kind": "eval",
            "step": self.step,
            "loss": stats.loss,
            "perplexity": stats.perplexity,
            "label_tokens": stats.label_tokens,
            **({"mtp_loss": stats.mtp_loss} if stats.mtp_loss is not None else {}),
        }

    def _evaluation_due(self) -> bool:
        s = self.settings
        return (
            self.eval_rows is not None
            and self.step > 0
            and ((s.eval_every and self.step % s.eval_every == 0) or self.step == s.steps)
        )

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
                    log.info(
                        "%s step %d/%d: loss %.4f ce %.4f balance %.4f lr %.3g grad %.3f %.0f tok/s",
                        self.stage,
                        self.step,
                        until,
                        record["loss"],
                        record["ce"],
                        record["balance_loss"],
                        record["lr"],
                        record["grad_norm"],
                        record["tokens_per_s"],
                    )
                if s.checkpoint_every and self.step % s.checkpoint_every == 0 and self.step < until:
                    self._checkpoint()
                kill_point(f"{self.stage}.step{self.step}")
        finally:
            if metrics:
                metrics.close()
        return next((r for r in reversed(self.history) if r["kind"] == "train"), {})

    def train_records(self) -> list[dict[str, Any]]:
        return [r for r in self.history if r["kind"] == "train"]


def train_stage(
    stage: Any,
    model: torch.nn.Module,
    settings: TrainSettings,
    rows: Sequence[Mapping[str, Any]],
    *,
    log_dir: str | os.PathLike | None,
    checkpoint_root: str | os.PathLike,
    key_settings: Mapping[str, Any],
    key_inputs: Sequence[str | os.PathLike],
    start_from: str | os.PathLike | None = None,
    until: int | None = None,
    eval_rows: Sequence[Mapping[str, Any]] | None = None,
    expert_selection: Mapping[str, Any] | None = None,
    peaks: PhasePeaks | None = None,
) -> Trainer:
    """Run one training stage: resume from its keyed checkpoint folder if one matches, else start
    (from ``start_from``, a full checkpoint, if given), train until ``until``. The caller writes its
    outputs, then calls ``trainer.remove_checkpoints()``."""
    runtime = [stage.precision, stage.seed, stage.threads, world_size()]
    key = C.checkpoint_key({"stage": stage.name, "settings": key_settings, "runtime": runtime}, key_inputs)
    trainer = Trainer(
        model,
        settings,
        rows,
        collate_fn=collate,
        seed=stage.seed,
        precision=stage.precision,
        stage=stage.name,
        eval_rows=eval_rows,
        log_dir=log_dir,
        checkpoint_dir=Path(checkpoint_root) / f"{stage.name}-{key}",
        expert_selection=expert_selection,
        peaks=peaks,
    )
    if not trainer.resume() and start_from is not None:
        trainer.load(start_from)
    trainer.run(until)
    return trainer
