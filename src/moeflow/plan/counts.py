"""Parameter counts from a model's shape: by category, active per token, LoRA's adapters.

The counts are exact on PyTorch's meta device where transformers (or moeflow.families) knows the family,
and in closed form otherwise. MTP layers (moeflow.families.mtp) are their own category: held in memory,
never run in the model's forward and never trained (so not active, and not in a full fine-tune's trained
parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from moeflow.families import registry
from moeflow.model.parameters import counted_category, is_hidden_matrix, layer_index
from moeflow.model.settings import LoraSettings
from moeflow.plan.shapes import (
    PlanError,
    Shape,
    hf_config_fields,
    model_config_fields,
    model_shape,
    resolve_vocab_size,
)
from moeflow.train.settings import EsftSettings

CATEGORIES = (
    "embedding",
    "lm_head",
    "attention",
    "norms",
    "dense_ffn",
    "routed_experts",
    "shared_experts",
    "router",
    "mtp",
)


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
    largest_layer_routed: int = 0  # routed-expert parameters of the decoder layer with the most (what EP splits)
    moe_layer_without_routed: int = 0  # the largest MoE layer without its routed experts
    hidden_matrices: int = 0  # the main layers' weight matrices (moeflow.model.parameters.is_hidden_matrix): Muon's

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def without_mtp(self) -> int:
        """The model's parameters without its MTP layers: what a full fine-tune trains."""
        return self.total - self.by_category.get("mtp", 0)

    @property
    def active(self) -> int:
        routed, model = self.by_category["routed_experts"], self.without_mtp
        return model - routed + routed * self.top_k // self.num_experts if self.num_experts else model

    @property
    def embeddings(self) -> int:
        return self.by_category["embedding"] + self.by_category["lm_head"]

    @property
    def flop_bearing(self) -> int:
        """:attr:`active` without the input embedding, whose lookup is a gather, not a matmul: the count behind
        ``6 N`` FLOPs per trained token (as moeflow.model.parameters.flop_bearing_per_token counts a built model).
        A head tied to the embedding is counted once, as the head."""
        tied = self.by_category["lm_head"] == 0
        return self.active - (0 if tied else self.by_category["embedding"])

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "total": self.total,
            "without_mtp": self.without_mtp,
            "active_per_token": self.active,
            "active_per_token_without_embeddings": self.active - self.embeddings,
            "flop_bearing_per_token": self.flop_bearing,
            "by_category": dict(self.by_category),
            "largest_layer": self.largest_layer,
            "largest_layer_without_routed_experts": self.largest_layer_without_routed,
            "largest_tensor": self.largest_tensor,
            "largest_layer_routed_experts": self.largest_layer_routed,
            "moe_layer_without_routed_experts": self.moe_layer_without_routed,
            "hidden_matrices": self.hidden_matrices,
        }


def attention_params(s: Shape, heads: int | None = None) -> int:
    """One layer's self-attention parameters (projections, their biases, q/k norms, gates, sinks), with
    ``heads`` query heads (the shape's ``num_heads`` if not given)."""
    h = s.hidden_size
    heads = s.num_heads if heads is None else heads
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        bias = int(s.attention_bias)
        if s.q_lora_rank is None:
            q = h * heads * qk_head
        else:
            q = h * s.q_lora_rank + bias * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * heads * qk_head
        kv_a = (h + bias) * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
        kv_b = s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim)
        o = heads * s.v_head_dim * h + bias * h
        return q + kv_a + kv_b + o
    q_dim, kv_dim = heads * s.head_dim, s.num_kv_heads * s.head_dim
    total = h * (q_dim + 2 * kv_dim) + q_dim * h
    total += int(s.qkv_bias) * (q_dim + 2 * kv_dim) + int(s.o_bias) * h
    total += {"head": 2 * s.head_dim, "full": q_dim + kv_dim, None: 0}[s.qk_norm]
    total += h * s.head_gate * heads + int(s.sinks) * heads
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


def mtp_layer_params(s: Shape, depth: int) -> int:
    """One MTP layer's parameters: its decoder layer (attention with its heads, two norms, an MoE or dense FFN),
    ``enorm``, ``hnorm``, ``eh_proj`` (2H x H), the shared head's norm and output layer, and its own embedding
    where the family has one."""
    h = s.hidden_size
    ffn = sum(moe_params(s).values()) if s.mtp_moe[depth] else 3 * h * s.dense_ffn
    own = s.vocab_size * h * (2 if s.mtp_embedding else 1)
    return attention_params(s, s.mtp_heads[depth]) + 2 * h + ffn + 2 * h + 2 * h * h + h + own


def formula_count(s: Shape) -> ParamCount:
    """Parameters in closed form from the shape (see the module docstring)."""
    h, layers = s.hidden_size, s.num_layers
    moe = moe_params(s)
    moe_set = set(s.moe_layers)
    attention = [attention_params(s, s.heads(i)) for i in range(layers)]
    by_category = {
        "embedding": s.vocab_size * h,
        "lm_head": 0 if s.tie_word_embeddings else s.vocab_size * h,
        "attention": sum(attention),
        "norms": (2 * layers + 1) * h,
        "dense_ffn": len(s.dense_layers) * 3 * h * s.dense_ffn,
        **{k: len(s.moe_layers) * v for k, v in moe.items()},
        "mtp": sum(mtp_layer_params(s, d) for d in range(s.mtp_layers)),
    }
    whole, without_routed = [], []
    for i in range(layers):
        common = attention[i] + 2 * h
        if i in moe_set:
            whole.append(common + sum(moe.values()))
            without_routed.append(common + moe["shared_experts"] + moe["router"])
        else:
            whole.append(common + 3 * h * s.dense_ffn)
            without_routed.append(whole[-1])
    return ParamCount(
        "formula",
        by_category,
        max(whole),
        max(without_routed),
        s.num_experts,
        s.top_k,
        largest_tensor(s),
        moe["routed_experts"] if s.moe_layers else 0,
        max((without_routed[i] for i in moe_set), default=0),
        hidden_matrix_count(s),
    )


def hidden_matrix_count(s: Shape) -> int:
    """The main layers' weight matrices (Muon's, moeflow.model.parameters.is_hidden_matrix): attention
    projections, dense and shared-expert FFNs, every routed expert's three matrices; no norm, bias or router."""
    h, moe_set = s.hidden_size, set(s.moe_layers)
    total = 0
    for layer in range(s.num_layers):
        total += sum(i * o for i, o in attention_matrices(s, s.heads(layer)))
        if layer in moe_set:
            total += 3 * h * (s.num_experts * s.expert_ffn + s.shared_ffn)
        else:
            total += 3 * h * s.dense_ffn
    return total


def largest_tensor(s: Shape) -> int:
    """Elements of the model's largest parameter: the embedding (or LM head), an attention or FFN matrix, a
    router, or an expert matrix: a whole layer's fused ``gate_up`` where the stack fuses the experts."""
    h = s.hidden_size
    heads = set(s.layer_heads or (s.num_heads,)) | set(s.mtp_heads)
    candidates = [s.vocab_size * h, *(i * o for n in heads for i, o in attention_matrices(s, n))]
    if s.dense_layers or not all(s.mtp_moe):
        candidates.append(h * s.dense_ffn)
    if s.mtp_layers:
        candidates.append(2 * h * h)  # eh_proj
    if s.moe_layers:
        fused = registry.experts_in_one_tensor(s.model_type)
        candidates += [h * s.shared_ffn, h * s.num_experts]
        candidates.append(s.num_experts * 2 * s.expert_ffn * h if fused else h * s.expert_ffn)
    return max(candidates)


def count_module(model: Any, shape: Shape) -> ParamCount:
    """Count a (meta-device or real) transformers model's parameters by category; tied weights once."""
    by_category = dict.fromkeys(CATEGORIES, 0)
    per_layer: dict[int, int] = {}
    routed_per_layer: dict[int, int] = {}
    hidden = 0
    for name, param in model.named_parameters():
        layer = layer_index(name)
        mtp = layer is not None and layer >= shape.num_layers  # the MTP layers come after the main ones
        category = "mtp" if mtp else counted_category(name)
        if category is None:
            raise PlanError(f"parameter {name!r}: the planner cannot tell what it belongs to")
        by_category[category] += param.numel()
        hidden += param.numel() if not mtp and is_hidden_matrix(name, tuple(param.shape)) else 0
        if layer is not None and not mtp:
            per_layer[layer] = per_layer.get(layer, 0) + param.numel()
            if category == "routed_experts":
                routed_per_layer[layer] = routed_per_layer.get(layer, 0) + param.numel()
    largest = max(per_layer.values(), default=0)
    without_routed = max((n - routed_per_layer.get(i, 0) for i, n in per_layer.items()), default=0)
    biggest = max((p.numel() for p in model.parameters()), default=0)
    routed = max(routed_per_layer.values(), default=0)
    moe_without = max((per_layer[i] - n for i, n in routed_per_layer.items()), default=0)
    return ParamCount(
        "meta",
        by_category,
        largest,
        without_routed,
        shape.num_experts,
        shape.top_k,
        biggest,
        routed,
        moe_without,
        hidden,
    )


# meta_count's results in this process, by the config's JSON and the shape: building a skeleton of a 30B-196B
# model with an nn.Module per expert (transformers 4.57) takes seconds, and the planner, the scale-out plan and
# the memory model ask for the same model's counts again.
_META_COUNTS: dict[tuple[str, str, Shape], ParamCount | None] = {}


def meta_count(config: Any, shape: Shape) -> ParamCount | None:
    """Exact counts from a meta-device instance, or None where no causal-LM class knows it on this stack. Each
    caller gets its own ``by_category`` (the cached count stays as counted)."""
    key = (type(config).__name__, config.to_json_string(use_diff=False), shape)
    if key not in _META_COUNTS:
        _META_COUNTS[key] = _meta_count(config, shape)
    cached = _META_COUNTS[key]
    return None if cached is None else replace(cached, by_category=dict(cached.by_category))


def _meta_count(config: Any, shape: Shape) -> ParamCount | None:
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


def attention_matrices(s: Shape, heads: int | None = None) -> list[tuple[int, int]]:
    """(in_features, out_features) of one layer's attention projections (the linear layers under self_attn),
    with ``heads`` query heads (the shape's ``num_heads`` if not given)."""
    h = s.hidden_size
    heads = s.num_heads if heads is None else heads
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = [(h, heads * qk_head)] if s.q_lora_rank is None else [(h, s.q_lora_rank), (s.q_lora_rank, heads * qk_head)]
        return q + [
            (h, s.kv_lora_rank + s.qk_rope_head_dim),
            (s.kv_lora_rank, heads * (s.qk_nope_head_dim + s.v_head_dim)),
            (heads * s.v_head_dim, h),
        ]
    q_dim, kv_dim = heads * s.head_dim, s.num_kv_heads * s.head_dim
    gate = [(h, s.head_gate * heads)] if s.head_gate else []
    return [(h, q_dim), (h, kv_dim), (h, kv_dim), (q_dim, h)] + gate


def lora_matrices(
    s: Shape, lora: LoraSettings, moe: bool, heads: int | None = None
) -> dict[str, list[tuple[int, int, int]]]:
    """The matrices one decoder layer (with ``heads`` query heads) adapts, by category, as
    moeflow.model.lora.find_targets picks them: (in_features, out_features, copies), copies being the routed
    experts that each hold one (else 1). MTP layers get none."""
    h, categories = s.hidden_size, set(lora.categories)
    swiglu = lambda width: [(h, width, 1), (h, width, 1), (width, h, 1)]  # noqa: E731
    out: dict[str, list[tuple[int, int, int]]] = {}
    if "attention" in categories:
        out["attention"] = [(i, o, 1) for i, o in attention_matrices(s, heads)]
    if moe:
        if "routed_experts" in categories:
            f = s.expert_ffn
            pairs = [(h, 2 * f), (f, h)] if registry.experts_fused(s.model_type) else [(h, f), (h, f), (f, h)]
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
    """``rank x (in + out)`` per adapted matrix (each expert's included) of every main layer, plus trainable
    router weights."""
    router = moe_params(s)["router"] if s.moe_layers and lora.router == "trainable" else 0
    by_category = dict.fromkeys(("attention", "dense_ffn", "shared_experts", "routed_experts", "router"), 0)
    moe_layer, dense_layer = (0, 0, 0), 0
    moe_set = set(s.moe_layers)
    for layer in range(s.num_layers):
        moe = layer in moe_set
        mats = lora_matrices(s, lora, moe, s.heads(layer))
        added = {c: sum(lora.rank * (i + o) * n for i, o, n in m) for c, m in mats.items()}
        for c, n in added.items():
            by_category[c] += n
        if moe:
            moe_layer = max(moe_layer, (sum(added.values()), added.get("routed_experts", 0), router))
        else:
            dense_layer = max(dense_layer, sum(added.values()))
    return LoraCount(
        by_category, router * len(s.moe_layers), moe_layer, dense_layer, registry.experts_fused(s.model_type)
    )


def lora_activation_elements(s: Shape, lora: LoraSettings, moe: bool, heads: int | None = None) -> int:
    """Elements per token kept by one layer's adapters: the rank-r intermediate of each adapted matrix a
    token passes through (top_k of the routed experts), and with dropout a copy of its input."""
    total = 0
    for category, mats in lora_matrices(s, lora, moe, heads).items():
        for in_features, _, copies in mats:
            seen = min(copies, s.top_k) if category == "routed_experts" else copies
            total += seen * (lora.rank + (in_features if lora.dropout else 0))
    return total


def esft_trainable(s: Shape, params: ParamCount, esft: EsftSettings, selected_experts: int | None) -> int:
    """Parameters with gradients and optimizer state under ``train.method: esft`` (moeflow.train.expert_mask):
    ``selected_experts`` (layer, expert) pairs where each expert is its own module, or every MoE layer's whole
    fused expert tensors where they are fused (each layer keeps at least one expert, and the tensor trains with
    its unselected rows masked); plus the shared experts and the non-expert parameters where configured.
    ``selected_experts`` None (no selection yet): every expert, the upper bound."""
    routed = params.by_category["routed_experts"]
    fused = registry.experts_in_one_tensor(s.model_type)
    if not fused and selected_experts is not None:
        routed = routed * selected_experts // (s.num_experts * len(s.moe_layers))
    shared = params.by_category["shared_experts"]
    others = params.without_mtp - params.by_category["routed_experts"] - shared - params.by_category["router"]
    return routed + (shared if esft.train_shared_experts else 0) + (others if esft.train_non_expert else 0)


# The categories whose weight matrices a quantized base holds in 4 or 8 bits (moeflow.model.quantization): the
# decoder layers' projections; not the embedding, norms, routers, output layer or MTP layers.
QUANTIZED_CATEGORIES = ("attention", "dense_ffn", "shared_experts", "routed_experts")


def quantized_parameters(params: ParamCount, quantization: str) -> int:
    """The parameters a base quantized in ``quantization`` (``model.quantization``, a LoRA run's) stores quantized."""
    return 0 if quantization == "none" else sum(params.by_category.get(c, 0) for c in QUANTIZED_CATEGORIES)
