"""The training maths: token-normalised cross-entropy and global-batch load balancing.

One optimizer step is several micro-batches (gradient accumulation), possibly on several ranks. The
loss of the step is defined on the whole step, and each micro-batch's backward adds exactly its share:

* Cross-entropy: the sum over the micro-batch's non-ignored (shifted) label tokens
  (``moeflow.model.chunked_loss``, by chunks of tokens) divided by the number of such tokens in the whole
  step, all ranks included. Summing the micro-batch gradients then gives the full-batch gradient
  (not the mean of per-micro-batch means).
* Load balancing (Qiu et al., arXiv 2501.11873): per MoE layer ``N_E * sum_i f_i * P_i`` with f_i the
  fraction of the step's top-k assignments that went to expert i (a count, no gradient) and P_i the
  mean router probability of expert i over the step's non-padding tokens; averaged over MoE layers.
  It equals 1 when the load is perfectly balanced (HF's ``load_balancing_loss_func`` reports top_k
  times this). P_i is a sum over tokens, so each micro-batch contributes ``sum_{its tokens} p / T_step``
  weighted by the step's f. Where f comes from is the mode:

  - ``exact``: a no-grad counting forward over the step's micro-batches first; the gradient equals
    the full batch's.
  - ``running`` (default, as Megatron-Core): f from the counts accumulated so far in the step
    (this micro-batch included). No extra compute; the last micro-batch uses the step's true f.
  - ``micro_batch``: the classic per-micro-batch loss (f and P of the micro-batch alone), averaged
    over the step's micro-batches.
  - ``off``.
* Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, averaged over layers.
* MTP loss (``train.mtp.mode: train``; moeflow.model.mtp_loss): each depth's summed cross-entropy divided by
  the step's label tokens, as the cross-entropy is, averaged over depths and weighted by ``loss_weight``.
* Loss-free balancing (DeepSeek-V3): after each step ``bias += rate * sign(mean load - load)``.

Counts (label tokens, routed tokens, expert selections) are all-reduced across ranks when
``torch.distributed`` is initialised, so each rank's loss is its share of the global step's loss and
the step's gradient is the sum of the ranks' gradients (``moeflow.parallel.gradients.reduce_gradients``);
:meth:`StepLoss.summary` all-reduces the logged terms too. Micro-batch graphs are released after each
backward (never ``retain_graph``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.data.collate import token_mask
from moeflow.parallel.process_group import all_reduce_sum, world_size
from moeflow.train.settings import BalanceSettings

LOSS_TERMS = ("balance", "ce", "z_loss", "mtp")  # the loss terms a step sums and reports, in summary order


@dataclass
class LayerRouter:
    """What the losses need from one MoE layer's router for one micro-batch (padding removed)."""

    logits: torch.Tensor  # (tokens, E) raw router logits, with gradient
    probs: torch.Tensor  # (tokens, E) router probabilities, with gradient
    topk_index: torch.Tensor  # (tokens, k) chosen experts

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]


def real_token_positions(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The flat (B * L) positions of the real tokens, or None when every position holds one.

    Computed from the batch as collated on the host: selecting these rows (``index_select``) costs the
    device no synchronisation, where a boolean mask on the device would (its result's size is read back).
    """
    mask = token_mask(batch).reshape(-1)
    return None if bool(mask.all()) else mask.nonzero().squeeze(1)


def expert_counts(layers: Sequence[LayerRouter]) -> torch.Tensor:
    """Top-k assignment counts per layer and expert, (L, E) float64 (exact integers), on the routers'
    device: one index_add over all layers (layer l's experts offset by l * E). Not bincount: on CUDA it
    reads the largest index back to the host to size its output."""
    if not layers:
        return torch.zeros(0, 0, dtype=torch.float64)
    experts = layers[0].num_experts
    index = torch.stack([layer.topk_index.reshape(-1) for layer in layers])
    index = (index + torch.arange(len(layers), device=index.device)[:, None] * experts).reshape(-1)
    counts = torch.zeros(len(layers) * experts, dtype=torch.float64, device=index.device)
    return counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64)).view(len(layers), experts)


def router_entropy(layers: Sequence[LayerRouter]) -> torch.Tensor:
    """Summed per-token entropy of the router distribution per layer, (L,) float64, no gradient."""
    if not layers:
        return torch.zeros(0, dtype=torch.float64)
    with torch.no_grad():
        p = torch.stack([layer.probs.detach() for layer in layers]).double()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        return -(p * p.clamp_min(1e-30).log()).sum((1, 2))


def balance_from_sums(counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """The global balancing loss value N_E * sum_i f_i P_i, averaged over layers (no gradient needed)."""
    if counts.numel() == 0 or num_tokens <= 0:
        return counts.new_zeros((), dtype=torch.float64)
    f = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    p = prob_sums.to(torch.float64) / num_tokens
    return (counts.shape[-1] * (f * p).sum(-1)).mean()


@dataclass
class StepLoss:
    """Normalisers and running statistics of one optimizer step; ``micro_batch_loss`` per micro-batch.

    Build it once the step's micro-batches are known: ``num_label_tokens`` and ``num_routed_tokens``
    are counted from the data (summed over ranks here). ``step_counts`` are the exact mode's counts.
    The running statistics and loss sums stay on the model's device (a read-back per micro-batch would
    stall the GPU); :meth:`summary` brings them to the host in one transfer per optimizer step.
    """

    settings: BalanceSettings
    num_label_tokens: int
    num_routed_tokens: int
    num_micro_batches: int
    step_counts: torch.Tensor | None = None
    running_counts: torch.Tensor | None = None
    prob_sums: torch.Tensor | None = None
    entropy_sums: torch.Tensor | None = None
    loss_sums: torch.Tensor | None = None  # (len(LOSS_TERMS),) float64: each term's micro-batch shares summed
    mtp_weight: float = 0.0  # train.mtp.loss_weight with mode train

    @classmethod
    def for_step(
        cls,
        settings: BalanceSettings,
        label_tokens: int,
        routed_tokens: int,
        num_micro_batches: int,
        step_counts: torch.Tensor | None = None,
        mtp_weight: float = 0.0,
    ) -> StepLoss:
        counts = all_reduce_sum(torch.tensor([label_tokens, routed_tokens], dtype=torch.float64))
        if settings.needs_counting_forward and step_counts is None:
            raise ValueError("balance mode 'exact' needs the step's expert counts (a counting forward) first")
        if step_counts is not None:
            step_counts = all_reduce_sum(step_counts.clone())
        return cls(settings, int(counts[0]), int(counts[1]), num_micro_batches, step_counts, mtp_weight=mtp_weight)

    def micro_batch_loss(
        self, ce_sum: torch.Tensor, layers: Sequence[LayerRouter], mtp_sums: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss (call ``.backward()`` on it, then drop it), from its
        summed next-token cross-entropy (``moeflow.model.chunked_loss``), its MoE layers' routing and, when the
        MTP layers train, each MTP depth's summed cross-entropy (``moeflow.model.mtp_loss.mtp_loss_sums``)."""
        s = self.settings
        ce = ce_sum / max(self.num_label_tokens, 1)
        loss = ce
        terms = {"ce": ce}
        if mtp_sums:
            terms["mtp"] = torch.stack([d.to(ce.dtype) for d in mtp_sums]).mean() / max(self.num_label_tokens, 1)
            loss = loss + self.mtp_weight * terms["mtp"]

        counts = expert_counts(layers)
        if self.loss_sums is None:
            self.loss_sums = torch.zeros(len(LOSS_TERMS), dtype=torch.float64, device=ce.device)
            self.running_counts = torch.zeros_like(counts)
            self.prob_sums = torch.zeros_like(counts)
            self.entropy_sums = counts.new_zeros(counts.shape[0])
        if layers:
            reduced = all_reduce_sum(counts.clone())
            self.running_counts += reduced
            prob_sums = torch.stack([layer.probs.sum(0) for layer in layers])
            self.prob_sums += prob_sums.detach().double()
            self.entropy_sums += router_entropy(layers)

        if s.balancing and layers:
            terms["balance"] = self._balance(counts, prob_sums, layers[0].probs.shape[0])
            loss = loss + s.coef * terms["balance"]
        if s.z_loss_coef > 0 and layers:
            z = torch.stack([torch.logsumexp(layer.logits.float(), -1).square().sum() for layer in layers])
            terms["z_loss"] = z.mean() / max(self.num_routed_tokens, 1)
            loss = loss + s.z_loss_coef * terms["z_loss"]
        with torch.no_grad():
            for i, name in enumerate(LOSS_TERMS):
                if name in terms:
                    self.loss_sums[i] += terms[name].detach().double()
        return loss

    def _balance(self, counts: torch.Tensor, prob_sums: torch.Tensor, local_tokens: int) -> torch.Tensor:
        mode = self.settings.mode
        if mode == "micro_batch":  # the mean over every rank's micro-batches (the ranks' gradients are summed)
            source, tokens, weight = counts, local_tokens, 1.0 / (self.num_micro_batches * world_size())
        else:
            source = self.step_counts if mode == "exact" else self.running_counts
            tokens, weight = self.num_routed_tokens, 1.0
        f = (source / source.sum(-1, keepdim=True).clamp_min(1)).to(prob_sums.device, prob_sums.dtype)
        per_layer = counts.shape[-1] * (f * prob_sums).sum(-1) / max(tokens, 1)
        return per_layer.mean() * weight

    @property
    def totals(self) -> dict[str, float]:
        """This rank's loss terms so far (a device-to-host transfer: for inspection, not for the loop)."""
        sums = self.loss_sums.tolist() if self.loss_sums is not None else [0.0] * len(LOSS_TERMS)
        return dict(zip(LOSS_TERMS, sums))

    def summary(self) -> dict[str, Any]:
        """The step's loss (``loss``), its terms and routing statistics, the same on every rank: each rank's terms
        are its share of the step's loss (normalised by the global counts), so their sum over ranks is the step's.
        Computed on the device, then read back in a single transfer."""
        loss_sums = self.loss_sums if self.loss_sums is not None else torch.zeros(len(LOSS_TERMS), dtype=torch.float64)
        parts = [all_reduce_sum(loss_sums.clone())]
        routed = self.running_counts is not None and self.running_counts.numel() > 0
        if routed:
            prob_sums = all_reduce_sum(self.prob_sums.clone())
            parts.append(balance_from_sums(self.running_counts, prob_sums, self.num_routed_tokens).reshape(1))
            parts.append(all_reduce_sum(self.entropy_sums.clone()) / max(self.num_routed_tokens, 1))
            parts.append(self.running_counts.reshape(-1))
        host = torch.cat(parts).cpu()
        out: dict[str, Any] = dict(zip(LOSS_TERMS, host[: len(LOSS_TERMS)].tolist()))
        s = self.settings  # the step's loss: the terms weighted as micro_batch_loss weighs them
        out["loss"] = out["ce"] + s.coef * out["balance"] + s.z_loss_coef * out["z_loss"] + self.mtp_weight * out["mtp"]
        out["label_tokens"] = self.num_label_tokens
        out["routed_tokens"] = self.num_routed_tokens
        if routed:
            layers, experts = self.running_counts.shape
            balance_global, entropy, counts = host[len(LOSS_TERMS) :].split([1, layers, layers * experts])
            out["balance_global"] = float(balance_global)
            out["router_entropy"] = entropy.tolist()
            out["counts"] = counts.view(layers, experts).to(torch.int64).tolist()
        return out


def update_correction_bias(biases: Sequence[torch.Tensor], counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3 loss-free balancing: ``bias += rate * sign(mean load - load)`` per layer, in place.

    ``counts`` are the step's expert counts (L, E), already summed over micro-batches and ranks, in
    the same layer order as ``biases``.
    """
    if rate <= 0 or not biases:
        return
    if len(biases) != counts.shape[0]:
        raise ValueError(f"{len(biases)} correction biases but counts for {counts.shape[0]} MoE layers")
    with torch.no_grad():
        for bias, load in zip(biases, counts):
            load = load.to(bias.device, torch.float64)
            bias += (rate * torch.sign(load.mean() - load)).to(bias.dtype)
