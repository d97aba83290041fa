"""Parameter counts from a model's shape: exact on PyTorch's meta device where transformers knows the
family, in closed form otherwise, by category, active per token, and LoRA's adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeflow.model.parameters import counted_category, layer_index
from moeflow.plan.shapes import (
    PlanError,
    Shape,
    experts_fused,
    hf_config_fields,
    model_config_fields,
    model_shape,
    resolve_vocab_size,
)
from moeflow.train.settings import LoraSettings

CATEGORIES = ("embedding", "lm_head", "attention", "norms", "dense_ffn", "routed_experts", "shared_experts", "router")


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by category, with the totals the planner uses."""

    method: str  # "meta" (exact, transformers built it on the meta device) or "formula"
    by_category: dict[str, int]
    largest_layer: int  # parameters of the largest decoder layer (the FSDP unit gathered at once)
    largest_layer_without_routed: int  # the same without its routed experts (the unit under expert parallelism)
    num_experts: int
    top_k: int
    largest_tensor: int  # elements of the largest single parameter (what the export gathers whole at once)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def active(self) -> int:
        routed = self.by_category["routed_experts"]
        return self.total - routed + routed * self.top_k // self.num_experts if self.num_experts else self.total

    @property
    def embeddings(self) -> int:
        return self.by_category["embedding"] + self.by_category["lm_head"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "total": self.total,
            "active_per_token": self.active,
            "active_per_token_without_embeddings": self.active - self.embeddings,
            "by_category": dict(self.by_category),
            "largest_layer": self.largest_layer,
            "largest_layer_without_routed_experts": self.largest_layer_without_routed,
            "largest_tensor": self.largest_tensor,
        }


def attention_params(s: Shape) -> int:
    """One layer's self-attention parameters (projections, their biases, q/k norms, gates, sinks)."""
    h = s.hidden_size
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        bias = int(s.attention_bias)
        if s.q_lora_rank is None:
            q = h * s.num_heads * qk_head
        else:
            q = h * s.q_lora_rank + bias * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.num_heads * qk_head
        kv_a = (h + bias) * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
        kv_b = s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)
        o = s.num_heads * s.v_head_dim * h + bias * h
        return q + kv_a + kv_b + o
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    total = h * (q_dim + 2 * kv_dim) + q_dim * h
    total += int(s.qkv_bias) * (q_dim + 2 * kv_dim) + int(s.o_bias) * h
    total += {"head": 2 * s.head_dim, "full": q_dim + kv_dim, None: 0}[s.qk_norm]
    total += h * s.head_gate + int(s.sinks) * s.num_heads
    return total


def moe_params(s: Shape) -> dict[str, int]:
    """One MoE layer's feed-forward parameters by category."""
    h = s.hidden_size
    per_expert = 3 * h * s.expert_ffn + int(s.expert_bias) * (2 * s.expert_ffn + h)
    return {
        "routed_experts": s.num_experts * per_expert,
        "shared_experts": 3 * h * s.shared_ffn + int(s.shared_gate) * h,
        "router": s.num_experts * h + int(s.router_bias) * s.num_experts,
    }


def formula_count(s: Shape) -> ParamCount:
    """Parameters in closed form from the shape (see the module docstring)."""
    h, layers = s.hidden_size, s.num_layers
    moe = moe_params(s)
    n_moe, n_dense = len(s.moe_layers), len(s.dense_layers)
    by_category = {
        "embedding": s.vocab_size * h,
        "lm_head": 0 if s.tie_word_embeddings else s.vocab_size * h,
        "attention": layers * attention_params(s),
        "norms": (2 * layers + 1) * h,
        "dense_ffn": n_dense * 3 * h * s.dense_ffn,
        **{k: n_moe * v for k, v in moe.items()},
    }
    common = attention_params(s) + 2 * h
    dense_layer = [common + 3 * h * s.dense_ffn] * bool(n_dense)
    moe_layer = [common + sum(moe.values())] * bool(n_moe)
    without_routed = [common + moe["shared_experts"] + moe["router"]] * bool(n_moe)
    return ParamCount(
        "formula",
        by_category,
        max(moe_layer + dense_layer),
        max(without_routed + dense_layer),
        s.num_experts,
        s.top_k,
        largest_tensor(s),
    )


def largest_tensor(s: Shape) -> int:
    """Elements of the model's largest parameter: the embedding (or LM head), an attention or FFN matrix, a
    router, or an expert matrix: a whole layer's fused ``gate_up`` where the stack fuses the experts."""
    h = s.hidden_size
    candidates = [s.vocab_size * h, *(i * o for i, o in attention_matrices(s))]
    if s.dense_layers:
        candidates.append(h * s.dense_ffn)
    if s.moe_layers:
        fused = experts_fused(s.model_type) or s.model_type == "granitemoe"  # granitemoe fuses on both stacks
        candidates += [h * s.shared_ffn, h * s.num_experts]
        candidates.append(s.num_experts * 2 * s.expert_ffn * h if fused else h * s.expert_ffn)
    return max(candidates)


def count_module(model: Any, shape: Shape) -> ParamCount:
    """Count a (meta-device or real) transformers model's parameters by category; tied weights once."""
    by_category = dict.fromkeys(CATEGORIES, 0)
    per_layer: dict[int, int] = {}
    routed_per_layer: dict[int, int] = {}
    for name, param in model.named_parameters():
        category = counted_category(name)
        if category is None:
            raise PlanError(f"parameter {name!r}: the planner cannot tell what it belongs to")
        by_category[category] += param.numel()
        layer = layer_index(name)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + param.numel()
            if category == "routed_experts":
                routed_per_layer[layer] = routed_per_layer.get(layer, 0) + param.numel()
    largest = max(per_layer.values(), default=0)
    without_routed = max((n - routed_per_layer.get(i, 0) for i, n in per_layer.items()), default=0)
    biggest = max((p.numel() for p in model.parameters()), default=0)
    return ParamCount("meta", by_category, largest, without_routed, shape.num_experts, shape.top_k, biggest)


def meta_count(config: Any, shape: Shape) -> ParamCount | None:
    """Exact counts from a meta-device instance, or None where transformers has no causal-LM class for it."""
    import torch

    from moeflow.model.configs import causal_lm_class

    try:
        with torch.device("meta"):  # a skeleton to count, not a model anything trains
            model = causal_lm_class().from_config(config)
    except (ValueError, KeyError):
        return None
    return count_module(model, shape)


def count_parameters(
    model: Mapping[str, Any], tokenizer_vocab: int | None = None
) -> tuple[Shape, ParamCount, ParamCount]:
    """The shape, the count the planner uses (meta where possible), and the formula's count."""
    fields = model_config_fields(model)
    vocab = resolve_vocab_size(fields, tokenizer_vocab)
    hf_fields, hf_config = hf_config_fields(fields, vocab)
    shape = model_shape(hf_fields, vocab)
    formula = formula_count(shape)
    exact = meta_count(hf_config, shape) if hf_config is not None else None
    return shape, exact or formula, formula


def attention_matrices(s: Shape) -> list[tuple[int, int]]:
    """(in_features, out_features) of one layer's attention projections (the linear layers under self_attn)."""
    h = s.hidden_size
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = (
            [(h, s.num_heads * qk_head)]
            if s.q_lora_rank is None
            else [(h, s.q_lora_rank), (s.q_lora_rank, s.num_heads * qk_head)]
        )
        return q + [
            (h, s.kv_lora_rank + s.qk_rope_head_dim),
            (s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)),
            (s.num_heads * s.v_head_dim, h),
        ]
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return [(h, q_dim), (h, kv_dim), (h, kv_dim), (q_dim, h)] + ([(h, s.head_gate)] if s.head_gate else [])


def lora_matrices(s: Shape, lora: LoraSettings, moe: bool) -> dict[str, list[tuple[int, int, int]]]:
    """The matrices one decoder layer adapts, by category, as moeflow.model.lora.find_targets picks them:
    (in_features, out_features, copies), copies being the routed experts that each hold one (else 1)."""
    h, categories = s.hidden_size, set(lora.categories)
    swiglu = lambda width: [(h, width, 1), (h, width, 1), (width, h, 1)]  # noqa: E731
    out: dict[str, list[tuple[int, int, int]]] = {}
    if "attention" in categories:
        out["attention"] = [(i, o, 1) for i, o in attention_matrices(s)]
    if moe:
        if "routed_experts" in categories:
            f = s.expert_ffn
            pairs = [(h, 2 * f), (f, h)] if experts_fused(s.model_type) else [(h, f), (h, f), (f, h)]
            out["routed_experts"] = [(i, o, s.num_experts) for i, o in pairs]
        if "shared_experts" in categories and s.shared_ffn:
            out["shared_experts"] = swiglu(s.shared_ffn)
        if lora.router == "adapter":
            out["router"] = [(h, s.num_experts, 1)]
    elif "dense_ffn" in categories and s.dense_ffn:
        out["dense_ffn"] = swiglu(s.dense_ffn)
    return out


@dataclass(frozen=True)
class LoraCount:
    """Adapter parameters of a LoRA fine-tune, counted from the config."""

    by_category: dict[str, int]  # adapter parameters (added to the model) by category
    router_weights: int  # router weights trained in full (router: trainable); part of the base count
    moe_layer: tuple[
        int, int, int
    ]  # one MoE layer's adapter parameters, those of its routed experts, its trainable router weights
    dense_layer: int  # one dense layer's adapter parameters
    fused_experts: bool

    def largest_layer(self, expert_parallel: bool) -> tuple[int, int]:
        """(adapter, trainable) parameters of the largest layer as FSDP gathers it; under expert
        parallelism the routed experts' adapters stay with their devices."""
        added, routed, router = self.moe_layer
        added -= routed if expert_parallel else 0
        return max(added, self.dense_layer), max(added + router, self.dense_layer)

    @property
    def added(self) -> int:
        return sum(self.by_category.values())

    @property
    def trainable(self) -> int:
        return self.added + self.router_weights

    def as_dict(self) -> dict[str, Any]:
        return {
            "by_category": dict(self.by_category),
            "adapter": self.added,
            "router_weights": self.router_weights,
            "trainable": self.trainable,
            "fused_experts": self.fused_experts,
        }


def lora_count(s: Shape, lora: LoraSettings) -> LoraCount:
    """``rank x (in + out)`` per adapted matrix (each expert's included), plus trainable router weights."""

    def per_layer(moe: bool) -> dict[str, int]:
        return {c: sum(lora.rank * (i + o) * n for i, o, n in mats) for c, mats in lora_matrices(s, lora, moe).items()}

    moe, dense = per_layer(True) if s.moe_layers else {}, per_layer(False) if s.dense_layers else {}
    router = moe_params(s)["router"] if s.moe_layers and lora.router == "trainable" else 0
    by_category = {
        c: moe.get(c, 0) * len(s.moe_layers) + dense.get(c, 0) * len(s.dense_layers)
        for c in ("attention", "dense_ffn", "shared_experts", "routed_experts", "router")
    }
    return LoraCount(
        by_category,
        router * len(s.moe_layers),
        (sum(moe.values()), moe.get("routed_experts", 0), router),
        sum(dense.values()),
        experts_fused(s.model_type),
    )


def lora_activation_elements(s: Shape, lora: LoraSettings, moe: bool) -> int:
    """Elements per token kept by one layer's adapters: the rank-r intermediate of each adapted matrix a
    token passes through (top_k of the routed experts), and with dropout a copy of its input."""
    total = 0
    for category, mats in lora_matrices(s, lora, moe).items():
        for in_features, _, copies in mats:
            seen = min(copies, s.top_k) if category == "routed_experts" else copies
            total += seen * (lora.rank + (in_features if lora.dropout else 0))
    return total
