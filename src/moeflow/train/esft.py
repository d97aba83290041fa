"""Expert relevance and per-layer expert selection for expert-specialised fine-tuning (ESFT, arXiv 2407.01906).

Relevance of expert ``e`` in MoE layer ``l`` over the task's tokens ``t = 1..N`` (padding excluded), with
``k`` experts chosen per token and ``w[t, e]`` the routing weight the chosen expert's output is multiplied by:

- ``token``: the share of the layer's top-k selections that went to ``e``:
  ``count(t : e in topk(t)) / (N * k)``; a layer's token scores sum to 1.
- ``gate``: the mean over tokens of the normalised gate weight, ``0`` where ``e`` was not chosen:
  ``(1/N) * sum_t g[t, e]`` with ``g[t, e] = w[t, e] / sum_{e' in topk(t)} w[t, e']`` (ESFT's average gate
  score; normalising per token removes routed scaling factors, so a layer's gate scores also sum to 1).

Per layer, ESFT keeps the smallest set of experts whose cumulative relevance, experts sorted by relevance
descending (ties: lower expert index first), reaches ``top_p``.

Rule esft_routing routes the fine-tuning corpus through the base model into :class:`RoutingTotals` (with
:class:`TotalsCollector` as an observer of the coverage stage's routing pass); rule esft_select scores and selects
from them (:func:`select_experts`) and draws :func:`selection_figure`. Training on the selection:
moeflow.train.expert_mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCORES = ("token", "gate")


@dataclass(frozen=True)
class EsftSelectStage:
    """Rule esft_select (moeflow.workflow.keys.esft_selection_settings): the routing totals' key, the relevance
    score and the share of it the selection reaches."""

    routing: str
    score: str
    top_p: float


@dataclass
class RoutingTotals:
    """Per (MoE layer, expert) sums over a task's tokens: top-k selections and normalised gate weights."""

    layers: list[int]  # decoder layer indices, in the order of the rows below
    top_k: int
    tokens: int  # tokens routed (padding excluded)
    selections: np.ndarray  # (L, E) int64: tokens on which the expert was among the top-k
    gate_sums: np.ndarray  # (L, E) float64: sum over tokens of the normalised gate weight

    def scores(self, score: str) -> np.ndarray:
        """(L, E) relevance by ``score`` (``token`` or ``gate``, see the module docstring)."""
        if score not in SCORES:
            raise ValueError(f"train.esft.score: {score!r} is not one of {list(SCORES)}")
        if self.tokens <= 0:
            raise ValueError("ESFT relevance: no tokens were routed (is the token budget or the training split empty?)")
        if score == "token":
            return self.selections / float(self.tokens * self.top_k)
        return self.gate_sums / float(self.tokens)


class TotalsCollector:
    """Accumulates ``RoutingTotals`` from captured routing (``moeflow.model.routing.LayerRouting``) batch by batch.

    Each batch's sums are kept apart under its place in the pass and added in place order by :meth:`finish`,
    also over the batches of several ranks (each routes its share): the float64 gate sums have the same digits
    whichever rank routed which batch. Per batch that is an (L, E) pair of arrays (Step-3.5-Flash: 45 x 288, 207 KB)."""

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int):
        self.layers = list(layers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.batches: dict[Any, tuple[int, np.ndarray, np.ndarray]] = {}  # place -> (tokens, selections, gate sums)

    def add(self, routing_layers: Sequence, keep: torch.Tensor, batch: Any = None) -> None:
        """Add one batch: ``routing_layers`` in ``layers`` order, ``keep`` the (tokens,) bool mask of real tokens,
        ``batch`` its place in the pass (sortable; default: after the batches added so far)."""
        keep = keep.reshape(-1).bool()
        selections = np.zeros((len(self.layers), self.num_experts), dtype=np.int64)
        gate_sums = np.zeros((len(self.layers), self.num_experts), dtype=np.float64)
        for row, routing in enumerate(routing_layers):
            index = routing.topk_index[keep].cpu()
            weight = routing.topk_weight[keep].detach().to(torch.float64).cpu()
            weight = weight / weight.sum(dim=-1, keepdim=True)
            flat = index.reshape(-1).numpy()
            selections[row] = np.bincount(flat, minlength=self.num_experts)
            gate_sums[row] = np.bincount(flat, weights=weight.reshape(-1).numpy(), minlength=self.num_experts)
        self.batches[len(self.batches) if batch is None else batch] = (int(keep.sum()), selections, gate_sums)

    def finish(self, ranks_batches: Sequence[Mapping[Any, tuple]] | None = None) -> RoutingTotals:
        """The totals of this collector's batches, or of every rank's (``ranks_batches``: each rank's
        :attr:`batches`), added in place order."""
        batches = self.batches if ranks_batches is None else {k: v for part in ranks_batches for k, v in part.items()}
        tokens = 0
        selections = np.zeros((len(self.layers), self.num_experts), dtype=np.int64)
        gate_sums = np.zeros((len(self.layers), self.num_experts), dtype=np.float64)
        for place in sorted(batches):
            count, selected, gates = batches[place]
            tokens += count
            selections += selected
            gate_sums += gates
        return RoutingTotals(self.layers, self.top_k, tokens, selections, gate_sums)


def select_layer(scores: np.ndarray, top_p: float) -> list[int]:
    """The smallest set of experts (indices, ascending) whose cumulative relevance reaches ``top_p``.

    Experts are taken by relevance descending, ties by lower index first. ``top_p`` is compared with a relative
    tolerance of 1e-9 so that a threshold equal to a cumulative sum (e.g. 0.5 = 0.25 + 0.25) is reached despite
    float rounding; a layer whose scores never reach it keeps every expert.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"train.esft.top_p: {top_p} must be in (0, 1]")
    order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
    chosen, total = [], 0.0
    target = top_p * (1 - 1e-9)
    for e in order:
        chosen.append(e)
        total += float(scores[e])
        if total >= target:
            break
    return sorted(chosen)


def select_experts(totals: RoutingTotals, score: str, top_p: float) -> dict:
    """The selection as the selection JSON holds it: settings, every score, the chosen experts per layer."""
    scores = totals.scores(score)
    return {
        "score": score,
        "top_p": top_p,
        "tokens": totals.tokens,
        "top_k": totals.top_k,
        "layers": [
            {"layer": layer, "scores": scores[row].tolist(), "selected": select_layer(scores[row], top_p)}
            for row, layer in enumerate(totals.layers)
        ],
    }


def task_rows(rows: Iterable[Mapping[str, Any]], token_budget: int) -> Iterator[Mapping[str, Any]]:
    """The split's first rows, whole, until ``token_budget`` tokens are reached (at least one row)."""
    tokens = 0
    for row in rows:
        if tokens >= token_budget:
            return
        tokens += len(row["input_ids"])
        yield row


def totals_json(totals: RoutingTotals) -> dict[str, Any]:
    return {
        "layers": totals.layers,
        "top_k": totals.top_k,
        "tokens": totals.tokens,
        "selections": totals.selections.tolist(),
        "gate_sums": totals.gate_sums.tolist(),
    }


def totals_from_json(data: Mapping[str, Any]) -> RoutingTotals:
    return RoutingTotals(
        [int(x) for x in data["layers"]],
        int(data["top_k"]),
        int(data["tokens"]),
        np.asarray(data["selections"], dtype=np.int64),
        np.asarray(data["gate_sums"], dtype=np.float64),
    )


def selection_figure(selection: Mapping[str, Any], path: str | Path, dpi: int = 120) -> None:
    """A heatmap of every (layer, expert) relevance, the selected experts outlined."""
    from matplotlib.patches import Rectangle

    from moeflow.runtime.figures import pyplot

    plt = pyplot()

    layers = selection["layers"]
    scores = np.asarray([entry["scores"] for entry in layers])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * scores.shape[1] + 2), max(2.5, 0.35 * len(layers) + 1.5)))
    image = ax.imshow(scores, aspect="auto", cmap="viridis", interpolation="nearest")
    for row, entry in enumerate(layers):
        for expert in entry["selected"]:
            ax.add_patch(Rectangle((expert - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_yticks(range(len(layers)), [str(entry["layer"]) for entry in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    chosen = sum(len(entry["selected"]) for entry in layers)
    ax.set_title(
        f"ESFT relevance ({selection['score']}), top_p {selection['top_p']}\n{chosen} of {scores.size} experts (red)"
    )
    fig.colorbar(image, ax=ax, label="relevance")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
