"""The batch evaluation loop: token-normalised loss without grad, and per-expert tokens and losses.

It runs a model over collated batches and sums the token-normalised loss and, for an MoE model, each expert's
routed tokens and the loss of the tokens it served.

The Trainer's periodic evaluation and the evaluation stage (``moeflow.evaluation.run_metrics``) both run it. With
several ranks each takes its share of the batches (:func:`batches` with ``rank``/``world``) and the
ranks' sums are added up (:func:`sum_stats`): the whole set's, on every rank.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moeflow.data.collate import collate, model_inputs, token_mask
from moeflow.data.shards import IGNORE_INDEX
from moeflow.model.chunked_loss import count_label_tokens, next_token_targets, token_losses
from moeflow.model.routing import capture
from moeflow.runtime.host_copies import model_device

FILLER = "filler"  # key of a batch a rank runs only to keep step with the others (see batches): not counted


@dataclass
class SetStats:
    """Sums over one evaluation set for one model. ``None`` expert arrays for a dense model."""

    loss_sum: float = 0.0
    label_tokens: int = 0
    sequences: int = 0
    input_tokens: int = 0  # non-padding tokens that went through the model
    routed: np.ndarray | None = None  # (L, E) top-k assignments
    served_loss_sum: np.ndarray | None = None  # (L, E) summed loss of the tokens each expert served
    served_label_tokens: np.ndarray | None = None  # (L, E) tokens with a label among them
    moe_layers: list[int] = field(default_factory=list)
    mtp_loss_sum: float | None = None  # with the MTP layers evaluated: each batch's mean over depths, summed
    seconds: float = 0.0  # wall time of the whole loop: reading and collating rows, forwards, statistics

    @property
    def loss(self) -> float:
        return self.loss_sum / self.label_tokens if self.label_tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def mtp_loss(self) -> float | None:
        """The MTP loss as training reports it: the mean over depths of each depth's cross-entropy, per label
        token (None when the MTP layers were not evaluated)."""
        if self.mtp_loss_sum is None:
            return None
        return self.mtp_loss_sum / self.label_tokens if self.label_tokens else float("nan")

    def add_routing(self, layer_ids: list[int], routed, loss_sum, label_tokens) -> None:
        if self.routed is None:
            self.moe_layers = list(layer_ids)
            self.routed, self.served_loss_sum, self.served_label_tokens = routed, loss_sum, label_tokens
        else:
            self.routed += routed
            self.served_loss_sum += loss_sum
            self.served_label_tokens += label_tokens


def routing_sums(layers, token_mask, token_loss, label_mask) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Per (layer, expert): assignments over ``token_mask``, summed loss and label count of the tokens served."""
    flat_tokens = token_mask.reshape(-1)
    flat_labels = label_mask.reshape(-1)
    flat_loss = token_loss.reshape(-1).double()
    routed, loss_sum, label_tokens = [], [], []
    for layer in layers:
        index = layer.topk_index.reshape(flat_tokens.shape[0], -1).cpu()
        k, num_experts = index.shape[1], layer.num_experts
        routed.append(torch.bincount(index[flat_tokens].reshape(-1), minlength=num_experts))
        served = index[flat_labels].reshape(-1)
        loss_sum.append(
            torch.bincount(served, weights=flat_loss[flat_labels].repeat_interleave(k), minlength=num_experts)
        )
        label_tokens.append(torch.bincount(served, minlength=num_experts))
    as_np = lambda rows, dtype: np.stack([r.numpy() for r in rows]).astype(dtype)  # noqa: E731
    return (
        [layer.layer for layer in layers],
        as_np(routed, np.int64),
        as_np(loss_sum, np.float64),
        as_np(label_tokens, np.int64),
    )


def evaluate_batches(
    model,
    batches: Iterable[Mapping[str, Any]],
    adapter=None,
    precision: str = "fp32",
    mtp: Callable[[Any, Mapping[str, Any]], float] | None = None,
) -> SetStats:
    """Run ``model`` over collated batches (``moeflow.data.collate.collate`` output) and sum loss and routing.

    ``adapter``: the model's ``moeflow.model.routing`` adapter, or None for a dense model (no expert statistics).
    Padding (negative ``doc_ids``, see ``moeflow.data.collate.token_mask``) is routed but not counted. ``mtp``:
    a batch's MTP loss from its forward's output with the last hidden state kept (the Trainer's, when the MTP
    layers train), summed too.
    """
    stats = SetStats(mtp_loss_sum=None if mtp is None else 0.0)
    keep_hidden = mtp is not None
    device = model_device(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    model.eval()
    started = time.perf_counter()
    with torch.no_grad(), autocast:
        for batch in batches:
            inputs = model_inputs(model, batch)
            labels = batch["labels"]
            if FILLER in batch:
                out = token_losses(model, inputs, labels, keep_hidden=keep_hidden)
                if mtp is not None:
                    mtp(out, batch)  # the MTP layers' forward is a collective too
                continue
            with capture(model, adapter) if adapter is not None else contextlib.nullcontext() as routing:
                out = token_losses(model, inputs, labels, keep_hidden=keep_hidden)
            if mtp is not None:
                stats.mtp_loss_sum += mtp(out, batch)
            stats.loss_sum += float(out.loss)
            stats.label_tokens += count_label_tokens(labels)
            stats.sequences += int(labels.shape[0])
            mask = token_mask(batch)
            stats.input_tokens += int(mask.sum())
            if routing is not None and routing.layers:
                label_mask = next_token_targets(labels) != IGNORE_INDEX
                stats.add_routing(*routing_sums(routing.layers, mask.cpu(), out.token_loss.cpu(), label_mask))
    stats.seconds = time.perf_counter() - started
    return stats


def batches(
    dataset,
    batch_size: int,
    attn_implementation: str,
    max_sequences: int | None = None,
    rank: int = 0,
    world: int = 1,
) -> Iterator[dict]:
    """Collated batches (``moeflow.data.collate.collate``) of ``batch_size`` packed rows, in order, from a
    data-stage split (a ``datasets.Dataset`` or a list of rows), with ``doc_ids`` (-1 on padding).

    With ``world`` ranks, rank ``rank`` takes batches rank, rank + world, ... of that sequence. Every rank
    yields as many batches: a sharded model's forward is a collective (FSDP gathers each layer, expert
    parallelism exchanges tokens), so a rank past its last batch runs the first batch again, marked
    :data:`FILLER` (not counted by :func:`evaluate_batches`)."""
    n = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    starts = range(0, n, batch_size)
    per_rank = math.ceil(len(starts) / world)
    for k in range(rank, per_rank * world, world):
        if k < len(starts):
            yield collate([dataset[i] for i in range(starts[k], min(starts[k] + batch_size, n))])
        else:
            yield {**collate([dataset[i] for i in range(min(batch_size, n))]), FILLER: True}


def sum_stats(parts: Sequence[SetStats]) -> SetStats:
    """The sums of several ranks' :class:`SetStats` over one set (in the order given, so the same digits on
    every rank); ``seconds``: the slowest rank's."""
    total = SetStats(seconds=max(p.seconds for p in parts))
    for part in parts:
        total.loss_sum += part.loss_sum
        total.label_tokens += part.label_tokens
        total.sequences += part.sequences
        total.input_tokens += part.input_tokens
        if part.mtp_loss_sum is not None:
            total.mtp_loss_sum = (total.mtp_loss_sum or 0.0) + part.mtp_loss_sum
        if part.routed is not None:
            total.add_routing(
                part.moe_layers, part.routed.copy(), part.served_loss_sum.copy(), part.served_label_tokens.copy()
            )
    return total
