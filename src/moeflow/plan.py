"""The memory planner: count parameters from a model config (no weights) and estimate per-device memory.

Parameters
    :func:`model_shape` reads a ``model.config`` mapping (``model_type`` plus the family's keys) into a
    :class:`Shape` for the families in ``FAMILIES``. :func:`count_parameters` counts exactly by building
    the model on PyTorch's meta device (no memory, no weights) wherever the installed transformers knows
    the family, and falls back to the closed-form :func:`formula_count` where it does not (step3p5 has
    no causal-LM class in transformers 4.57 or 5.x). Both report the same categories; the tests check
    the formula against the meta count. *Active* parameters per token are everything except the routed
    experts, plus ``top_k / num_experts`` of them; embeddings and the LM head count as active (the usual
    convention: Step-3.5-Flash's "11B active" includes them).

Memory per device (bytes), for a job of ``micro_batch_size`` sequences of ``seq_len`` tokens; the terms
are summed, a conservative peak (the loss's buffers and the gathered layers of the backward pass
are not all live at the same instant):
    * weights: parameters x 2 (bf16) or 4 (fp32);
    * gradients: trainable parameters x the same width;
    * optimizer (AdamW): trainable parameters x 8 (two fp32 moments), + 4 for an fp32 master copy with bf16;
      either way 16 bytes per trainable parameter, the same total as moeflow.train's bf16 autocast
      (fp32 weights 4 + fp32 gradients 4 + moments 8) and as FSDP mixed precision (fp32 sharded master
      weights 4 + fp32 sharded gradients 4 + moments 8);
    * with ``num_devices > 1`` these three are sharded over the devices (FSDP full sharding, bf16 as FSDP
      mixed precision: bf16 parameters gathered and computed with, fp32 masters, fp32 gradient reduction),
      and each device also holds, in the gathered width (2 for bf16, 4 for fp32):
        - unsharded_layer: the largest decoder layer (one FSDP unit) while it runs, its weights and its
          unsharded gradient; with expert parallelism (``Job.expert_parallel``) the routed experts stay
          with their devices and only the rest of that layer is gathered;
        - prefetched_layer: the next unit's weights, all-gathered while this one runs;
        - layer_gradient_reduce: the unit's gradient copied into the fp32 reduce-scatter buffer;
        - root_unit: the root unit (embedding, LM head, final norm), gathered for the whole step (the
          root is not resharded after the forward pass), and its gradient, held until the end of backward;
    * residual_stream: the layer inputs kept for the backward pass, ``T x layers x H`` with gradient
      checkpointing (``2 x`` without: the input and the residual after attention), with ``T =
      micro_batch_size x seq_len`` tokens, in fp32 where the weights are fp32 (fp32, and bf16 autocast on
      one device), in bf16 under FSDP mixed precision;
    * activations, per device (each device runs its own micro-batch), in the compute width ``a`` (2 for
      bf16, 4 for fp32):
        - per layer and token, the tensors kept for the backward pass: attention ``2H + (q + 2kv) d +
          q d + q`` (layer input, norm output, q/k/v, attention output, softmax statistics; plus the
          head gates where the model has them), plus ``q x seq_len`` attention probabilities with eager
          attention; ``2H`` for the FFN's norm input and output; then a dense FFN ``3 I``, or an MoE FFN
          ``2E + k (2H + 3 I_e) + 3 I_s + H`` (router scores, each token's copy into and out of its
          k experts with their gate/up/activation, the shared expert); MLA (deepseek_v3) uses its
          latent and per-head widths for q/k/v;
        - without checkpointing: ``T x a x sum over layers``; with gradient checkpointing: ``T x a x the
          largest layer`` (one layer recomputed at a time); less the layer inputs the residual stream
          counts, plus the final norm;
    * loss: moeflow.linear_loss applies the output layer to ``C = min(model.loss_chunk_tokens, T)`` tokens
      at a time: ``C x vocab x (4 + 2 with bf16)`` (a chunk's fp32 logits, turned into their gradient in
      place, and with bf16 the product before its fp32 copy and the gradient's bf16 copy), plus what it
      keeps from the forward to the backward pass, in fp32: the hidden states' gradient ``T x H x 4``, the
      output weight's gradient ``vocab x H x 4`` when the output layer trains (not with LoRA), and the
      per-token losses ``T x 4``;
    * runtime: a fixed overhead (the CUDA context with NCCL's and cuBLAS's buffers, or the interpreter and
      libraries on CPU).

The device's memory is ``hardware.memory_gib_per_device``, on CUDA as torch sees a card of that nominal
size (``VISIBLE_GIB``: 79.11 GiB of an 80 GB H100), or what verify_env measured (torch's total).

Host memory, load phase (``plan()["host"]``): moeflow.modeling.load_model loads the whole model in fp32
on every rank before FSDP moves it to the GPUs (under expert parallelism transformers 5 loads each
rank's share), so a node holds ``ranks_per_node x (4 x parameters + runtime per rank)``. It is compared
with the training job's ``mem_mb`` when the caller knows it, else with this machine's RAM. The plan's
settings name no parallel layout: ``ranks_per_node`` is all ``hardware.num_devices`` (one node).

The job *fits* when the total is at most ``1 - HEADROOM`` of the device memory, is *tight* up to the
full memory (a warning), and *does not fit* above it: :func:`enforce` then raises with the numbers and
what would make it fit (the smallest device count, checkpointing, shorter sequences, micro-batch 1).

``train.method: lora`` (settings ``train.lora``, see moeflow.lora): the base weights are frozen (weights
only, no gradients or optimizer states); the adapters get all three (16 bytes per parameter, as above),
and so do the routers' weights with ``router: trainable``. Adapter parameters are counted from the config:
``rank x (in + out)`` for every adapted matrix (:func:`lora_matrices`), i.e. per layer q/k/v/o (plus
step3p5's head gate; MLA: its down/up projections), the dense or shared SwiGLU's gate/up/down, a router
adapter ``rank x (hidden + experts)``, and per routed expert gate/up/down on transformers 4.57 (separate
linear layers) or its fused gate_up ``rank x (hidden + 2 I_e)`` and down projection on transformers 5
(``target_parameters``; GPT-OSS fuses on both), so the same config plans slightly differently per stack.
Activations add, per adapted matrix a token passes through (k of the routed experts), the rank-r
intermediate and, with dropout, a copy of the matrix's input. A full fine-tune that does not fit is
offered LoRA (the ``train.lora`` settings) among the suggestions, with the devices it needs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import MODEL_SCHEMA, LoraSettings, with_defaults
from .config import settings as config_settings
from .env import device_memory_bytes
from .parameters import counted_category, layer_index

log = logging.getLogger("moeflow.plan")

GIB = 2**30
HEADROOM = 0.10
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}
ADAM_MOMENT_BYTES = 8  # two fp32 moments
MASTER_WEIGHT_BYTES = {"fp32": 0, "bf16": 4}  # an fp32 master copy when the weights are bf16
RUNTIME_OVERHEAD_BYTES = {"cuda": 1 * GIB, "cpu": GIB // 2}  # the CUDA context (with NCCL's and cuBLAS's buffers)
FP32_BYTES = 4  # FSDP's gradient reduce-scatter (reduce_dtype fp32), and the residual stream with fp32 weights
LOSS_BYTES_PER_LOGIT = 4  # a chunk's fp32 logits, which become their gradient in place (moeflow.linear_loss)
# What torch.cuda reports as a card's total memory, by the nominal size configs and profiles name
# (hardware.memory_gib_per_device): "GPU 0 has a total capacity of 79.11 GiB" on an H100 80GB.
VISIBLE_GIB = {80: 79.11, 24: 23.68}  # H100 / A100 80GB; RTX 4090
# Host memory of the load phase: moeflow.modeling.load_model loads the whole model in fp32 on every rank
# before moeflow.distributed.shard_model moves it to its GPU, so a node holds ranks x the fp32 model.
LOAD_BYTES = 4
HOST_RUNTIME_BYTES = {"cuda": 3 * GIB, "cpu": 1 * GIB}  # per rank: interpreter, torch, CUDA's host libraries


class PlanError(ValueError):
    """A model config the planner cannot read, or a job that does not fit (with the numbers)."""


# --------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class Shape:
    """What the parameter count and the activation estimate need from a decoder-only MoE config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_ffn: int  # FFN width of the dense layers
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # width of the always-active shared expert(s); 0 when there is none
    shared_gate: bool = False  # qwen2_moe: a sigmoid gate (H -> 1) on the shared expert
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim; "full": over all heads (olmoe)
    head_gate: int = 0  # step3p5: outputs of g_proj (one gate per head, or per head dimension)
    sinks: bool = False  # gpt_oss: one learned attention sink per head
    expert_bias: bool = False  # gpt_oss: biases on the experts' projections
    router_bias: bool = False  # gpt_oss
    # Multi-head latent attention (deepseek_v3); attention == "mla" uses these instead of num_kv_heads/head_dim.
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)


_MISSING = object()


def _get(fields: Mapping[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of ``keys`` present (and not null) in ``fields``; an error naming them if none is."""
    for key in keys:
        if fields.get(key) is not None:
            return fields[key]
    if default is _MISSING:
        raise PlanError(
            f"config key 'model.config.{keys[0]}' is required for model_type {fields.get('model_type')!r}"
            + (f" (also read as: {', '.join(keys[1:])})" if len(keys) > 1 else "")
        )
    return default


def _attention_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    hidden = int(_get(f, "hidden_size"))
    heads = int(_get(f, "num_attention_heads"))
    return {
        "hidden_size": hidden,
        "num_layers": int(_get(f, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(_get(f, "num_key_value_heads", "num_attention_groups", default=heads)),
        "head_dim": int(_get(f, "head_dim", default=hidden // heads)),
        "tie_word_embeddings": bool(_get(f, "tie_word_embeddings", default=False)),
    }


def _qwen_moe_layers(f: Mapping[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    """qwen2_moe / qwen3_moe: MoE every ``decoder_sparse_step`` layers, except ``mlp_only_layers``."""
    step = int(_get(f, "decoder_sparse_step", default=1))
    dense = set(_get(f, "mlp_only_layers", default=[]) or [])
    return tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)


def _qwen_moe_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    """The fields qwen2_moe and qwen3_moe share: attention, dense FFN, experts and where they are."""
    base = _attention_fields(f)
    experts = int(_get(f, "num_experts"))
    return base | {
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": _qwen_moe_layers(f, base["num_layers"], experts),
        "num_experts": experts,
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": int(_get(f, "moe_intermediate_size")),
    }


def _qwen3_moe(f: Mapping[str, Any]) -> dict[str, Any]:
    return _qwen_moe_fields(f) | {
        "qkv_bias": bool(_get(f, "attention_bias", default=False)),
        "o_bias": bool(_get(f, "attention_bias", default=False)),
        "qk_norm": "head",
    }


def _qwen2_moe(f: Mapping[str, Any]) -> dict[str, Any]:
    return _qwen_moe_fields(f) | {
        "shared_ffn": int(_get(f, "shared_expert_intermediate_size")),
        "shared_gate": True,
        "qkv_bias": bool(_get(f, "qkv_bias", default=True)),
    }


def _all_moe(f: Mapping[str, Any], experts_key: str) -> dict[str, Any]:
    """mixtral, granitemoe, olmoe, gpt_oss: every layer is MoE and ``intermediate_size`` is the expert width."""
    base = _attention_fields(f)
    return base | {
        "dense_ffn": 0,
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": int(_get(f, experts_key)),
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": int(_get(f, "intermediate_size")),
    }


def _mixtral(f: Mapping[str, Any]) -> dict[str, Any]:
    return _all_moe(f, "num_local_experts")


def _olmoe(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(_get(f, "attention_bias", default=False))
    return _all_moe(f, "num_experts") | {"qk_norm": "full", "qkv_bias": bias, "o_bias": bias}


def _gpt_oss(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(_get(f, "attention_bias", default=True))
    return _all_moe(f, "num_local_experts") | {
        "qkv_bias": bias,
        "o_bias": bias,
        "sinks": True,
        "expert_bias": True,
        "router_bias": True,
    }


def _deepseek_v3(f: Mapping[str, Any]) -> dict[str, Any]:
    base = _attention_fields(f)
    first_dense = int(_get(f, "first_k_dense_replace", default=0))
    expert_ffn = int(_get(f, "moe_intermediate_size"))
    q_lora = _get(f, "q_lora_rank", default=None)
    return base | {
        "attention": "mla",
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": tuple(range(first_dense, base["num_layers"])),
        "num_experts": int(_get(f, "n_routed_experts")),
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(_get(f, "n_shared_experts", default=0)) * expert_ffn,
        "q_lora_rank": int(q_lora) if q_lora is not None else None,
        "kv_lora_rank": int(_get(f, "kv_lora_rank")),
        "qk_nope_head_dim": int(_get(f, "qk_nope_head_dim")),
        "qk_rope_head_dim": int(_get(f, "qk_rope_head_dim")),
        "v_head_dim": int(_get(f, "v_head_dim")),
        "attention_bias": bool(_get(f, "attention_bias", default=False)),
    }


def _step3p5(f: Mapping[str, Any]) -> dict[str, Any]:
    """Step-3.5-Flash, from transformers 5's Step3p7TextConfig keys or the hub config's legacy ones."""
    base = _attention_fields(f)
    n = base["num_layers"]
    sliding_heads = f.get("num_sliding_attention_heads")
    if sliding_heads is not None and int(sliding_heads) != base["num_heads"]:
        raise PlanError(
            "config key 'model.config.num_sliding_attention_heads': a head count for sliding-window layers "
            "that differs from num_attention_heads is not supported by the planner"
        )
    if f.get("mlp_layer_types"):
        moe_layers = tuple(i for i, kind in enumerate(f["mlp_layer_types"][:n]) if kind == "sparse")
    elif f.get("moe_layers_enum") is not None:
        enum = f["moe_layers_enum"]
        items = enum.split(",") if isinstance(enum, str) else enum
        moe_layers = tuple(sorted(i for i in {int(x) for x in items if str(x).strip()} if i < n))
    else:
        moe_layers = tuple(range(3, n))  # transformers' default: layers 0-2 dense
    gating = f.get("gating", True)
    per_head = gating is True or gating == "per-head"
    expert_ffn = int(_get(f, "moe_intermediate_size"))
    return base | {
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": moe_layers,
        "num_experts": int(_get(f, "n_routed_experts", "moe_num_experts", "num_local_experts")),
        "top_k": int(_get(f, "num_experts_per_tok", "moe_top_k")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(_get(f, "share_expert_dim", "share_expert_dims", default=expert_ffn)),
        "qkv_bias": bool(_get(f, "attention_bias", default=False)),
        "o_bias": bool(_get(f, "attention_bias", default=False)),
        "qk_norm": "head",
        "head_gate": (base["num_heads"] if per_head else base["num_heads"] * base["head_dim"]) if gating else 0,
    }


FAMILIES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "granitemoe": _mixtral,  # the same fields and shapes (experts fused as input_linear/output_linear)
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "step3p5": _step3p5,
}


def resolve_vocab_size(config_fields: Mapping[str, Any], tokenizer_vocab: int | None) -> int:
    """``model.config.vocab_size`` when present (large published configs), else the tokenizer's size."""
    vocab = config_fields.get("vocab_size") or tokenizer_vocab
    if not vocab:
        raise PlanError("no vocabulary size: set model.config.vocab_size or tokenizer.vocab_size")
    return int(vocab)


def model_shape(config_fields: Mapping[str, Any], vocab_size: int) -> Shape:
    model_type = config_fields.get("model_type")
    if model_type not in FAMILIES:
        raise PlanError(
            f"config key 'model.config.model_type': the planner knows {', '.join(sorted(FAMILIES))}; got {model_type!r}"
        )
    fields = FAMILIES[model_type](config_fields)
    return Shape(model_type=model_type, vocab_size=int(vocab_size), **fields)


# --------------------------------------------------------------------------- counting parameters


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
        "formula", by_category, max(moe_layer + dense_layer), max(without_routed + dense_layer), s.num_experts, s.top_k
    )


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
    return ParamCount("meta", by_category, largest, without_routed, shape.num_experts, shape.top_k)


class ConfigView(Mapping[str, Any]):
    """A transformers config read by key (its attribute names and aliases, defaults filled in), over the raw mapping."""

    def __init__(self, config: Any, raw: Mapping[str, Any]):
        self._config, self._raw = config, dict(raw)

    def __getitem__(self, key: str) -> Any:
        value = getattr(self._config, key, None)
        if value is None and key in self._raw:
            return self._raw[key]
        if value is None and not hasattr(self._config, key):
            raise KeyError(key)
        return value

    def __iter__(self):
        return iter(sorted(set(self._raw) | set(self._config.to_dict())))

    def __len__(self) -> int:
        return len(list(iter(self)))


def hf_config_fields(model_cfg: Mapping[str, Any], vocab_size: int) -> tuple[Mapping[str, Any], Any]:
    """The config as transformers reads it (defaults included) and the config object, if it knows the type."""
    from .modeling import ModelError, build_config

    raw = dict(model_cfg["config"]) | {"vocab_size": vocab_size}
    try:
        config = build_config(model_cfg, vocab_size)
    except (ModelError, KeyError, ValueError, TypeError):
        return raw, None
    return ConfigView(config, raw), config


def meta_count(config: Any, shape: Shape) -> ParamCount | None:
    """Exact counts from a meta-device instance, or None where transformers has no causal-LM class for it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):
        return None
    return count_module(model, shape)


def model_config_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """``model.config``, or the ``config.json`` of ``model.pretrained`` when a pretrained folder is used."""
    pretrained = with_defaults(model, MODEL_SCHEMA)["pretrained"]  # tests give model sections of a few keys
    if pretrained:
        path = Path(pretrained) / "config.json"
        if not path.is_file():
            raise PlanError(f"config key 'model.pretrained': {path} does not exist")
        return json.loads(path.read_text(encoding="utf-8"))
    return dict(model["config"])


def count_parameters(
    model: Mapping[str, Any], tokenizer_vocab: int | None = None
) -> tuple[Shape, ParamCount, ParamCount]:
    """The shape, the count the planner uses (meta where possible), and the formula's count."""
    fields = model_config_fields(model)
    vocab = resolve_vocab_size(fields, tokenizer_vocab)
    hf_fields, hf_config = hf_config_fields({**model, "config": fields}, vocab)
    shape = model_shape(hf_fields, vocab)
    formula = formula_count(shape)
    exact = meta_count(hf_config, shape) if hf_config is not None else None
    return shape, exact or formula, formula


# --------------------------------------------------------------------------- LoRA adapters


def experts_fused(model_type: str) -> bool:
    """Whether the installed transformers keeps a layer's routed experts as fused 3D parameters (gate and
    up projections in one ``gate_up_proj``): every family on transformers 5, GPT-OSS on both stacks."""
    from .compat import is_transformers_v5

    return model_type == "gpt_oss" or is_transformers_v5()


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
    """The matrices one decoder layer adapts, by category, as moeflow.lora.find_targets picks them:
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


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Job:
    """The training settings memory depends on."""

    precision: str
    method: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    attn_implementation: str
    device: str
    num_devices: int
    expert_parallel: bool  # experts split over the devices (transformers 5's DistributedConfig)
    lora: LoraSettings  # train.lora: used when method is lora (and for the LoRA suggestion)
    loss_chunk_tokens: int  # model.loss_chunk_tokens: the cross-entropy's tokens per chunk
    ranks_per_node: int  # the ranks that load the model on one host (the host plan)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Job:
        """The job of ``moeflow.config.plan_settings``."""
        train, hardware = settings["train"], settings["hardware"]
        if train["optimizer"] != "adamw":
            raise PlanError(f"config key 'train.optimizer': the planner knows adamw, got {train['optimizer']!r}")
        return cls(
            precision=settings["precision"],
            method=train["method"],
            micro_batch_size=int(train["micro_batch_size"]),
            seq_len=int(settings["seq_len"]),
            gradient_checkpointing=bool(train["gradient_checkpointing"]),
            attn_implementation=settings["model"]["attn_implementation"],
            device=hardware["device"],
            num_devices=int(hardware["num_devices"]),
            expert_parallel=False,
            # a full run's settings carry no train.lora: the LoRA suggestion uses the defaults
            lora=config_settings(LoraSettings, train["lora"] or {}),
            loss_chunk_tokens=int(settings["model"]["loss_chunk_tokens"]),
            # the settings name no parallel layout: one node of all the devices (moeflow.scaleout sets its own)
            ranks_per_node=int(hardware["num_devices"]),
        )

    @property
    def sharded(self) -> bool:
        """FSDP over the devices: one decoder layer (and the root unit) gathered at a time."""
        return self.num_devices > 1

    @property
    def mixed_precision(self) -> bool:
        """FSDP mixed precision (moeflow.distributed with precision bf16): bf16 parameters gathered and
        computed with, fp32 sharded master weights and an fp32 gradient reduce-scatter. On one device bf16
        is autocast over fp32 weights."""
        return self.sharded and self.precision == "bf16"


def layer_activation_elements(s: Shape, seq_len: int, eager: bool, moe: bool, lora: LoraSettings | None = None) -> int:
    """Elements kept for the backward pass per token by one decoder layer (module docstring)."""
    h = s.hidden_size
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        qkv = (s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_rope_head_dim
        qkv += s.num_heads * (2 * qk_head + s.qk_nope_head_dim + s.v_head_dim)
        attn_out = s.num_heads * s.v_head_dim
    else:
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        attn_out = s.num_heads * s.head_dim
    attention = 2 * h + qkv + attn_out + s.num_heads + s.head_gate + (s.num_heads * seq_len if eager else 0)
    ffn_in = 2 * h  # residual into the second norm, and the norm's output
    if moe:
        ffn = 2 * s.num_experts + s.top_k * (2 * h + 3 * s.expert_ffn) + (3 * s.shared_ffn + h if s.shared_ffn else 0)
    else:
        ffn = 3 * s.dense_ffn
    return attention + ffn_in + ffn + (lora_activation_elements(s, lora, moe) if lora else 0)


def kept_layer_inputs(s: Shape, job: Job) -> int:
    """Residual-stream tensors kept per token for the backward pass: each layer's input with gradient
    checkpointing (what the recomputation starts from), its input and its residual after attention without."""
    return s.num_layers * s.hidden_size * (1 if job.gradient_checkpointing else 2)


def residual_stream_bytes(s: Shape, job: Job) -> int:
    """The kept residual stream, in fp32 where the weights are fp32 (fp32, or bf16 autocast on one device:
    the embedding's output and the residual additions stay fp32), in bf16 under FSDP mixed precision."""
    width = WEIGHT_BYTES[job.precision] if job.mixed_precision else FP32_BYTES
    return job.micro_batch_size * job.seq_len * kept_layer_inputs(s, job) * width


def activation_bytes(s: Shape, job: Job) -> int:
    """The decoder layers' other kept tensors, in the compute width (the residual stream and the loss
    are their own terms)."""
    tokens = job.micro_batch_size * job.seq_len
    width = WEIGHT_BYTES[job.precision]
    eager = job.attn_implementation == "eager"
    lora = job.lora if job.method == "lora" else None
    moe_layer = layer_activation_elements(s, job.seq_len, eager, True, lora) if s.moe_layers else 0
    dense_layer = layer_activation_elements(s, job.seq_len, eager, False, lora) if s.dense_layers else 0
    if job.gradient_checkpointing:  # one layer recomputed at a time, from its kept input
        per_token = max(moe_layer, dense_layer) - s.hidden_size
    else:
        per_token = len(s.moe_layers) * moe_layer + len(s.dense_layers) * dense_layer - kept_layer_inputs(s, job)
    per_token += 2 * s.hidden_size  # final norm
    return tokens * per_token * width


def loss_bytes(s: Shape, job: Job) -> int:
    """The chunked cross-entropy (moeflow.linear_loss): one chunk's logits, ``LOSS_BYTES_PER_LOGIT`` per
    token and vocabulary entry plus, with bf16, the product before its fp32 copy and the gradient's bf16
    copy; and the fp32 gradients it computes in the forward pass and keeps for the backward pass."""
    tokens = job.micro_batch_size * job.seq_len
    chunk = min(job.loss_chunk_tokens, tokens)
    width = WEIGHT_BYTES[job.precision]
    per_logit = LOSS_BYTES_PER_LOGIT + (width if width < FP32_BYTES else 0)
    output_trains = job.method != "lora"
    kept = tokens * (s.hidden_size + 1) + (s.vocab_size * s.hidden_size if output_trains else 0)
    return chunk * s.vocab_size * per_logit + kept * FP32_BYTES


def root_unit_parameters(s: Shape, params: ParamCount) -> int:
    """The FSDP root unit: what no decoder layer holds (the embedding, the LM head, the final norm)."""
    return params.embeddings + s.hidden_size


def memory_per_device(s: Shape, params: ParamCount, job: Job) -> dict[str, int]:
    """Bytes per device by component (module docstring); ``total`` is their sum."""
    width = WEIGHT_BYTES[job.precision]
    shards = job.num_devices
    # FSDP gathers one layer at a time (and holds its full gradient until the reduce-scatter); under
    # expert parallelism each device keeps its own experts whole, so only the rest of a layer is gathered.
    unit = params.largest_layer_without_routed if job.expert_parallel else params.largest_layer
    root = root_unit_parameters(s, params)
    if job.method == "lora":  # frozen base: weights only; adapters (and a trainable router) get everything
        adapters = lora_count(s, job.lora)
        added, trainable = adapters.added, adapters.trainable
        unit_added, unit_trainable = adapters.largest_layer(job.expert_parallel)
        root_trainable = 0  # no adapters on the embedding or the LM head
    else:
        added, trainable, unit_added, unit_trainable, root_trainable = 0, params.total, 0, unit, root
    gathered = unit + unit_added
    out = {
        "weights": math.ceil((params.total + added) * width / shards),
        "gradients": math.ceil(trainable * width / shards),
        "optimizer": math.ceil(trainable * (ADAM_MOMENT_BYTES + MASTER_WEIGHT_BYTES[job.precision]) / shards),
        "unsharded_layer": (gathered * width + unit_trainable * width) if job.sharded else 0,
        "prefetched_layer": gathered * width if job.sharded else 0,
        "layer_gradient_reduce": unit_trainable * FP32_BYTES if job.sharded else 0,
        "root_unit": (root + root_trainable) * width if job.sharded else 0,
        "residual_stream": residual_stream_bytes(s, job),
        "activations": activation_bytes(s, job),
        "loss": loss_bytes(s, job),
        "runtime": RUNTIME_OVERHEAD_BYTES[job.device],
    }
    out["total"] = sum(out.values())
    return out


def host_memory(params: ParamCount, job: Job) -> dict[str, int]:
    """Host bytes per node in the load phase: every rank's fp32 model (under expert parallelism only its
    share: transformers 5 loads each rank's slices) and each rank's runtime; ``total`` is their sum."""
    model = params.total * LOAD_BYTES
    per_rank = math.ceil(model / job.num_devices) if job.expert_parallel else model
    out = {
        "model": job.ranks_per_node * per_rank,
        "runtime": job.ranks_per_node * HOST_RUNTIME_BYTES[job.device],
    }
    out["total"] = sum(out.values())
    return out


def verdict(total: int, memory: int) -> str:
    if total <= (1 - HEADROOM) * memory:
        return "fits"
    return "tight" if total <= memory else "does_not_fit"


def device_memory(settings: Mapping[str, Any], env_report: Mapping[str, Any]) -> tuple[int, str]:
    """One device's memory: ``hardware.memory_gib_per_device`` (on CUDA what torch sees of a card of that
    nominal size, ``VISIBLE_GIB``), else measured by verify_env (torch's total)."""
    hardware = settings["hardware"]
    nominal = hardware["memory_gib_per_device"]
    if nominal and hardware["device"] == "cuda" and nominal in VISIBLE_GIB:
        return (
            int(VISIBLE_GIB[nominal] * GIB),
            f"hardware.memory_gib_per_device: {nominal:g}, {VISIBLE_GIB[nominal]} GiB visible to torch",
        )
    if nominal:
        return int(nominal * GIB), "hardware.memory_gib_per_device"
    measured, source = device_memory_bytes(env_report, hardware["device"])
    if measured is None:
        raise PlanError(
            f"hardware.device is {hardware['device']!r} but {source}: set hardware.memory_gib_per_device to plan "
            "for a machine you do not have, or hardware.device: cpu"
        )
    if hardware["device"] == "cpu" and hardware["num_devices"] > 1:
        return measured // hardware["num_devices"], f"{source}, shared by {hardware['num_devices']} CPU ranks"
    return measured, source


def min_devices(s: Shape, params: ParamCount, job: Job, memory: int, limit: int = 1_000_000) -> int | None:
    """The smallest device count at which the job fits with headroom, or None if no count does."""
    if verdict(memory_per_device(s, params, dataclasses.replace(job, num_devices=1))["total"], memory) == "fits":
        return 1
    at_two = memory_per_device(s, params, dataclasses.replace(job, num_devices=2))
    sharded = 2 * (at_two["weights"] + at_two["gradients"] + at_two["optimizer"])
    replicated = at_two["total"] - sharded / 2
    room = (1 - HEADROOM) * memory - replicated
    if room <= 0:
        return None
    n = max(2, math.ceil(sharded / room))
    while n <= limit:  # ceil() of the shards can add a byte or two: step up until it really fits
        if verdict(memory_per_device(s, params, dataclasses.replace(job, num_devices=n))["total"], memory) == "fits":
            return n
        n += 1
    return None


def max_seq_len(s: Shape, params: ParamCount, job: Job, memory: int) -> int | None:
    """The longest sequence (at most the job's) that fits on the job's devices, or None."""
    lo, hi = 0, job.seq_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if verdict(memory_per_device(s, params, dataclasses.replace(job, seq_len=mid))["total"], memory) == "fits":
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def suggestions(s: Shape, params: ParamCount, job: Job, memory: int) -> list[dict[str, Any]]:
    """What would make the job fit: each change with the devices it needs and the per-device total there."""
    lean = {"gradient_checkpointing": True, "micro_batch_size": 1}
    candidates = [("shard over more devices (FSDP, one layer gathered at a time)", job)]
    if s.moe_layers and not job.expert_parallel:
        ep = dataclasses.replace(job, expert_parallel=True)
        candidates += [
            ("FSDP with expert parallelism (transformers 5 only)", ep),
            ("expert parallelism, gradient checkpointing and micro-batch 1", dataclasses.replace(ep, **lean)),
        ]
    if job.method == "full":
        lora = dataclasses.replace(job, method="lora")
        what = f"rank {job.lora.rank} on {', '.join(job.lora.targets)}, router {job.lora.router}"
        candidates += [
            (f"train.method: lora ({what})", lora),
            (
                f"train.method: lora ({what}), gradient checkpointing and micro-batch 1",
                dataclasses.replace(lora, **lean),
            ),
        ]
        if s.moe_layers and not job.expert_parallel:
            candidates.append(
                (
                    f"train.method: lora ({what}) with expert parallelism, gradient checkpointing and micro-batch 1",
                    dataclasses.replace(lora, expert_parallel=True, **lean),
                )
            )
    candidates += [
        ("train.gradient_checkpointing: true", dataclasses.replace(job, gradient_checkpointing=True)),
        ("train.micro_batch_size: 1", dataclasses.replace(job, micro_batch_size=1)),
        ("gradient checkpointing and micro-batch 1", dataclasses.replace(job, **lean)),
        ("model.attn_implementation: sdpa", dataclasses.replace(job, attn_implementation="sdpa")),
    ]
    for base, label in (
        (job, ""),
        (dataclasses.replace(job, **lean), " with gradient checkpointing and micro-batch 1"),
    ):
        longest = max_seq_len(s, params, base, memory)
        if longest and longest < job.seq_len:
            candidates.append((f"data.seq_len: {longest}{label}", dataclasses.replace(base, seq_len=longest)))
    options, seen = [], {job}
    for change, variant in candidates:
        if variant in seen and variant != job:
            continue
        seen.add(variant)
        devices = min_devices(s, params, variant, memory)
        at = dataclasses.replace(variant, num_devices=devices or variant.num_devices)
        sharded = memory_per_device(s, params, dataclasses.replace(variant, num_devices=max(2, variant.num_devices)))
        states = sharded["weights"] + sharded["gradients"] + sharded["optimizer"]
        options.append(
            {
                "change": change,
                "unshardable_gib": _gib(sharded["total"] - states),
                "fits_as_is": verdict(memory_per_device(s, params, variant)["total"], memory) == "fits",
                "min_devices": devices,
                "per_device_gib_at_min_devices": _gib(memory_per_device(s, params, at)["total"]) if devices else None,
            }
        )
    return [o for o in options if o["fits_as_is"] or o["min_devices"] or o["change"] == candidates[0][0]]


def host_plan(params: ParamCount, job: Job, env_report: Mapping[str, Any], mem_mb: int | None) -> dict[str, Any]:
    """The load phase on one host against the training job's ``mem_mb`` (SLURM megabytes: MiB) when
    known, else against this machine's RAM (verify_env report)."""
    if mem_mb:
        limit, source = int(mem_mb) * 2**20, "the training job's mem_mb"
    else:
        limit, source = device_memory_bytes(env_report, "cpu")
    per_node = host_memory(params, job)
    return {
        "phase": "load",
        "ranks_per_node": job.ranks_per_node,
        "load_dtype": "fp32",
        "per_node_bytes": per_node,
        "per_node_gib": {k: _gib(v) for k, v in per_node.items()},
        "limit_bytes": limit,
        "limit_source": source,
        "verdict": verdict(per_node["total"], limit),
    }


def plan(settings: Mapping[str, Any], env_report: Mapping[str, Any], mem_mb: int | None = None) -> dict[str, Any]:
    """The full plan for one run: parameters, memory per device, the verdict and what would make it fit,
    and the host memory of loading the model (against ``mem_mb``, the training job's, when given)."""
    shape, params, formula = count_parameters(settings["model"], settings["vocab_size"])
    job = Job.from_settings(settings)
    memory, source = device_memory(settings, env_report)
    per_device = memory_per_device(shape, params, job)
    result = verdict(per_device["total"], memory)
    out = {
        "model_type": shape.model_type,
        "shape": dataclasses.asdict(shape)
        | {"moe_layers": list(shape.moe_layers), "dense_layers": list(shape.dense_layers)},
        "parameters": params.as_dict()
        | {"formula_total": formula.total, "formula_matches": formula.total == params.total},
        "job": dataclasses.asdict(job),
        "device_memory_bytes": memory,
        "device_memory_source": source,
        "per_device_bytes": per_device,
        "per_device_gib": {k: _gib(v) for k, v in per_device.items()},
        "usable_fraction": 1 - HEADROOM,
        "verdict": result,
        "min_devices": min_devices(shape, params, job, memory),
        "suggestions": suggestions(shape, params, job, memory) if result != "fits" else [],
        "host": host_plan(params, job, env_report, mem_mb),
    }
    if job.method == "lora":
        out["lora"] = {**job.lora.as_dict(), **lora_count(shape, job.lora).as_dict()}
    return out


# --------------------------------------------------------------------------- messages


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _size(n: float) -> str:
    if n == 0:
        return "0"
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def summary(p: Mapping[str, Any]) -> str:
    """The plan in a few lines: parameters, memory per device by component, the verdict and the options."""
    job, mem, gib, params = p["job"], p["per_device_bytes"], p["per_device_gib"], p["parameters"]
    memory = p["device_memory_bytes"] / GIB
    usable = p["usable_fraction"] * memory
    lines = [
        f"{job['method']} fine-tune of {p['model_type']} with {_count(params['total'])} parameters "
        f"({_count(params['active_per_token'])} active per token), {job['precision']}, micro-batch "
        f"{job['micro_batch_size']} x {job['seq_len']} tokens, gradient checkpointing "
        f"{'on' if job['gradient_checkpointing'] else 'off'}, on {job['num_devices']} x {job['device']} of "
        f"{memory:.1f} GiB ({p['device_memory_source']}):",
        *(
            [
                f"  LoRA rank {p['lora']['rank']} on {', '.join(p['lora']['targets'])}, router {p['lora']['router']}: "
                f"{_count(p['lora']['trainable'])} trainable parameters ({_count(p['lora']['adapter'])} in adapters); "
                f"the {_count(params['total'])} base weights are frozen"
            ]
            if "lora" in p
            else []
        ),
        f"  per device {_size(mem['total'])} = weights {_size(mem['weights'])} + gradients {_size(mem['gradients'])} + "
        f"AdamW states {_size(mem['optimizer'])} + unsharded layer {_size(mem['unsharded_layer'])} + prefetched "
        f"layer {_size(mem['prefetched_layer'])} + layer gradient reduce {_size(mem['layer_gradient_reduce'])} + "
        f"root unit {_size(mem['root_unit'])} + residual stream {_size(mem['residual_stream'])} + activations "
        f"{_size(mem['activations'])} + loss {_size(mem['loss'])} + runtime {_size(mem['runtime'])}",
        f"  verdict: {p['verdict'].replace('_', ' ')} (usable {usable:.1f} of {memory:.1f} GiB, "
        f"{round(100 * (1 - p['usable_fraction']))}% headroom)",
        host_summary(p["host"]),
    ]
    if p["suggestions"]:
        states = gib["weights"] + gib["gradients"] + gib["optimizer"]
        if states > usable:
            lines.append(
                f"  weights, gradients and AdamW states alone take {states:.2f} GiB per device: only more devices "
                f"(or frozen weights) help; shorter sequences or checkpointing cannot"
            )
        lines.append(f"  what would make it fit (devices of {memory:.1f} GiB):")
        for option in p["suggestions"]:
            if option["fits_as_is"]:
                where = f"fits on {job['num_devices']} device(s)"
            elif option["min_devices"]:
                where = (
                    f"at least {option['min_devices']} devices "
                    f"({option['per_device_gib_at_min_devices']:.2f} GiB per device there)"
                )
            else:
                where = (
                    f"no number of these devices: the gathered units, activations, loss and runtime alone take "
                    f"{option['unshardable_gib']:.2f} GiB per device"
                )
            lines.append(f"    - {option['change']}: {where}")
    return "\n".join(lines)


def host_summary(host: Mapping[str, Any]) -> str:
    per_node = host["per_node_bytes"]
    return (
        f"  host, loading: {_size(per_node['total'])} per node = {host['ranks_per_node']} rank(s) x (the "
        f"{host['load_dtype']} model + runtime): model {_size(per_node['model'])} + runtime "
        f"{_size(per_node['runtime'])}; "
        f"{host['verdict'].replace('_', ' ')} in {_size(host['limit_bytes'])} ({host['limit_source']})"
    )


def enforce(p: Mapping[str, Any]) -> None:
    """Fail when the job does not fit (with the numbers and the options), or its model does not load within
    the training job's ``mem_mb``; warn when either is tight (or the load exceeds this machine's RAM)."""
    if p["verdict"] == "does_not_fit":
        raise PlanError("the training job does not fit in memory:\n" + summary(p))
    host = p["host"]
    if host["verdict"] == "does_not_fit" and host["limit_source"] == "the training job's mem_mb":
        raise PlanError("the training job's ranks cannot load the model within its mem_mb:\n" + summary(p))
    if p["verdict"] == "tight":
        log.warning("the training job fits with less than %d%% headroom:\n%s", round(HEADROOM * 100), summary(p))
    elif host["verdict"] != "fits":
        log.warning(
            "loading the model on the host leaves less than %d%% headroom:\n%s", round(HEADROOM * 100), summary(p)
        )


def render_markdown(p: Mapping[str, Any]) -> str:
    params, mem = p["parameters"], p["per_device_bytes"]
    rows = [f"| {k} | {v:,} |" for k, v in params["by_category"].items()]
    mem_rows = [f"| {k.replace('_', ' ')} | {_size(v)} | {v:,} |" for k, v in mem.items()]
    host = p["host"]
    host_rows = [f"| {k} | {_size(v)} | {v:,} |" for k, v in host["per_node_bytes"].items()]
    host_rows.append(f"| limit ({host['limit_source']}) | {_size(host['limit_bytes'])} | {host['limit_bytes']:,} |")
    formula = "agrees" if params["formula_matches"] else f"differs: {params['formula_total']:,}"
    return (
        "\n".join(
            [
                f"# Memory plan: {p['model_type']}",
                "",
                "```",
                summary(p),
                "```",
                "",
                f"## Parameters ({params['method']} count; formula {formula})",
                "",
                "| category | parameters |",
                "|---|---|",
                *rows,
                f"| **total** | {params['total']:,} |",
                f"| active per token | {params['active_per_token']:,} |",
                f"| active per token without embeddings | {params['active_per_token_without_embeddings']:,} |",
                "",
                "## Memory per device",
                "",
                "| component | size | bytes |",
                "|---|---|---|",
                *mem_rows,
                "",
                f"## Host memory per node, loading ({host['ranks_per_node']} rank(s))",
                "",
                "| component | size | bytes |",
                "|---|---|---|",
                *host_rows,
                "",
                "The formulas are in the docstring of `moeflow.plan`.",
                *(
                    [
                        "",
                        "## LoRA adapters",
                        "",
                        "| category | adapter parameters |",
                        "|---|---|",
                        *[f"| {k} | {v:,} |" for k, v in p["lora"]["by_category"].items() if v],
                        f"| router weights trained in full | {p['lora']['router_weights']:,} |",
                        f"| **trainable** | {p['lora']['trainable']:,} |",
                    ]
                    if "lora" in p
                    else []
                ),
            ]
        )
        + "\n"
    )
