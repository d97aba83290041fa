"""Routing drift: how fine-tuning moved the router, per MoE layer, over the same tokens.

A run's base and fine-tuned model route the coverage validation set, token by token, in
``moeflow.evaluation.loop`` batches (moeflow.evaluation.token_routing, in rule evaluate_model, which keeps each
model's routing beside its record: :func:`write_routing`); rule routing_drift compares the two with no model.

Per MoE layer, over the non-padding tokens:

* ``js_divergence``: the Jensen-Shannon divergence (base 2, so in [0, 1]) of the two expert-load
  distributions, an expert's load being its share of the layer's top-k assignments;
* ``changed_expert_set_fraction``: the fraction of tokens whose set of chosen experts differs (the order
  within the top-k does not count);
* ``gained`` / ``lost``: the experts whose load share rose / fell by more than half the base's share
  (``LOAD_CHANGE``); an expert the base never chose gains as soon as it is chosen;
* ``entropy_base`` / ``entropy_finetuned`` / ``entropy_change``: the mean per-token entropy (nats) of the
  routing probabilities (``moeflow.model.routing.LayerRouting.probs``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from moeflow.runtime.files import atomic_file

LOAD_CHANGE = 0.5  # an expert gained or lost load: its share moved by more than half the base's share


@dataclass
class LayerTokens:
    """One model's routing of a set at one MoE layer, token by token (padding left out)."""

    layer: int
    num_experts: int
    expert_sets: np.ndarray  # (tokens, k) the chosen experts of each token, sorted
    entropy_sum: float  # summed per-token entropy of the routing probabilities (nats)

    @property
    def tokens(self) -> int:
        return int(self.expert_sets.shape[0])

    def load_share(self) -> np.ndarray:
        """(E,) each expert's share of the layer's top-k assignments."""
        counts = np.bincount(self.expert_sets.reshape(-1), minlength=self.num_experts).astype(np.float64)
        return counts / max(counts.sum(), 1.0)

    @property
    def mean_entropy(self) -> float:
        return self.entropy_sum / self.tokens if self.tokens else float("nan")


def js_divergence(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence of two distributions, base 2 (0: the same, 1: disjoint supports)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    m = (p + q) / 2

    def kl_to_m(x: np.ndarray) -> float:
        nonzero = x > 0
        return float(np.sum(x[nonzero] * np.log2(x[nonzero] / m[nonzero])))

    return max(0.0, (kl_to_m(p) + kl_to_m(q)) / 2)


def changed_set_fraction(base: np.ndarray, finetuned: np.ndarray) -> float:
    """The fraction of tokens whose (sorted) chosen-expert rows differ between two (tokens, k) arrays."""
    if base.shape != finetuned.shape:
        raise ValueError(f"routing of different tokens: {base.shape} vs {finetuned.shape}")
    return float(np.any(base != finetuned, axis=1).mean()) if len(base) else 0.0


def moved_experts(
    base_share: np.ndarray, finetuned_share: np.ndarray, load_change: float = LOAD_CHANGE
) -> tuple[list[int], list[int]]:
    """(gained, lost): experts whose share rose above / fell below (1 +- ``load_change``) x the base's."""
    gained = np.flatnonzero(finetuned_share > base_share * (1 + load_change))
    lost = np.flatnonzero(finetuned_share < base_share * (1 - load_change))
    return gained.tolist(), lost.tolist()


def layer_drift(base: LayerTokens, finetuned: LayerTokens) -> dict[str, Any]:
    """The drift record of one MoE layer (the keys of drift.json's ``layers``)."""
    if (base.layer, base.num_experts) != (finetuned.layer, finetuned.num_experts):
        raise ValueError(
            f"layer {base.layer} ({base.num_experts} experts) compared with "
            f"layer {finetuned.layer} ({finetuned.num_experts} experts)"
        )
    p, q = base.load_share(), finetuned.load_share()
    gained, lost = moved_experts(p, q)
    return {
        "layer": base.layer,
        "js_divergence": js_divergence(p, q),
        "changed_expert_set_fraction": changed_set_fraction(base.expert_sets, finetuned.expert_sets),
        "gained": gained,
        "lost": lost,
        "entropy_base": base.mean_entropy,
        "entropy_finetuned": finetuned.mean_entropy,
        "entropy_change": finetuned.mean_entropy - base.mean_entropy,
        "load_base": p.tolist(),
        "load_finetuned": q.tolist(),
    }


def drift_record(base: Sequence[LayerTokens], finetuned: Sequence[LayerTokens]) -> dict[str, Any]:
    """drift.json without provenance: ``layers`` (one record per MoE layer) and ``tokens`` compared."""
    if [b.layer for b in base] != [f.layer for f in finetuned]:
        raise ValueError(
            f"MoE layers differ: base {[b.layer for b in base]}, fine-tuned {[f.layer for f in finetuned]}"
        )
    return {
        "layers": [layer_drift(b, f) for b, f in zip(base, finetuned)],
        "tokens": base[0].tokens if base else 0,
    }


@dataclass(frozen=True)
class RoutingDriftStage:
    """Rule routing_drift: the run whose base and fine-tuned model's routings it compares."""

    run: str


# The routing file of a model without MoE layers holds no tensor; safetensors needs one.
NO_LAYERS = "no_moe_layers"


def write_routing(path: str | os.PathLike, layers: Sequence[LayerTokens]) -> None:
    """A model's routing of a set (``layers``, one per MoE layer) as a safetensors file: each layer's chosen experts
    (tokens, k), its number of experts and entropy sum in the metadata; the same routing gives the same bytes."""
    tensors = {f"layer.{t.layer}": np.ascontiguousarray(t.expert_sets, dtype=np.int32) for t in layers}
    meta = {str(t.layer): {"num_experts": t.num_experts, "entropy_sum": t.entropy_sum} for t in layers}
    data = save(tensors or {NO_LAYERS: np.zeros(0, dtype=np.int32)}, metadata={"layers": json.dumps(meta)})
    with atomic_file(path, "wb") as f:
        f.write(data)


def read_routing(path: str | os.PathLike) -> list[LayerTokens]:
    """The routing :func:`write_routing` wrote, layer by layer (none for a model without MoE layers)."""
    with safe_open(str(path), framework="np") as f:
        meta = json.loads(f.metadata()["layers"])
        return [
            LayerTokens(int(layer), int(m["num_experts"]), f.get_tensor(f"layer.{layer}"), float(m["entropy_sum"]))
            for layer, m in sorted(meta.items(), key=lambda item: int(item[0]))
        ]
