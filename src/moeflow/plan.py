"""The memory planner: count parameters from a model config (no weights) and estimate memory per rank in
every phase of a training job (load, step, checkpoint, resume, export).

Parameters
    :func:`model_shape` reads a ``model.config`` mapping (``model_type`` plus the family's keys) into a
    :class:`Shape` for the families in ``FAMILIES``. :func:`count_parameters` counts exactly by building
    the model on PyTorch's meta device (no memory, no weights) wherever the installed transformers knows
    the family, and falls back to the closed-form :func:`formula_count` where it does not (step3p5 has
    no causal-LM class in transformers 4.57 or 5.x). Both report the same categories; the tests check
    the formula against the meta count. *Active* parameters per token are everything except the routed
    experts, plus ``top_k / num_experts`` of them; embeddings and the LM head count as active (the usual
    convention: Step-3.5-Flash's "11B active" includes them).

Memory per device in a training step (bytes, :func:`memory_per_device`, the ``step`` phase), for a job of
``micro_batch_size`` sequences of ``seq_len`` tokens; the terms are summed, a conservative peak (the loss's
buffers and the gathered layers of the backward pass are not all live at the same instant):
    * weights: parameters x 2 (bf16) or 4 (fp32);
    * gradients: trainable parameters x the same width;
    * optimizer (AdamW): trainable parameters x 8 (two fp32 moments), + 4 for an fp32 master copy with bf16;
      either way 16 bytes per trainable parameter, the same total as moeflow.train's bf16 autocast
      (fp32 weights 4 + fp32 gradients 4 + moments 8) and as FSDP mixed precision (fp32 sharded master
      weights 4 + fp32 sharded gradients 4 + moments 8);
    * with ``parallel.strategy`` fsdp or ep (``Job.shard_ranks > 1``: ``parallel.fsdp_size``, all ranks by
      default; a config without ranks but several ``hardware.num_devices`` is planned as FSDP over them)
      these three are sharded over the ranks (FSDP full sharding, bf16 as FSDP
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
    * runtime: a fixed overhead (the CUDA context with NCCL's and cuBLAS's buffers; on CPU the measured
      resident set of a training rank's interpreter, torch, transformers and gloo: ``CPU_RANK_RUNTIME_BYTES``).
    ``parallel.strategy: none`` on several ranks (``Job.replicated``): every rank holds all of it, unsharded.

The phases (:func:`phase_memory`, per rank; the resident state is the parameters in fp32, ``PARAM_BYTES``,
frozen ones included, and AdamW's two fp32 moments of the trained ones, both over ``Job.shard_ranks``):
    * load: the rank's share of the weights, allocated empty and filled with the rows it owns from the
      folder's safetensors (moeflow.sharded_load; ``none`` and one rank load the whole model), plus on the
      pinned stack (FSDP1) the largest unit materialised whole while it is wrapped, plus on CUDA one
      tensor's owned rows read into a host buffer;
    * step: :func:`memory_per_device`;
    * checkpoint: the resident state (the gradients are freed after each step; each rank writes its own
      shards, moeflow.checkpoint), plus on CUDA one tensor's shard staged on the host;
    * resume: the resident state (the model, then AdamW's shards read into) and the zero gradients of the
      step torch.distributed.checkpoint initialises a fresh optimizer's state with, plus on CUDA one
      tensor's read buffer;
    * export: the resident state and one whole parameter gathered on every rank (the largest:
      ``ParamCount.largest_tensor``, the embedding, or a layer's fused experts on transformers 5), staged on
      the host on CUDA; rank 0 streams each tensor to its file (no buffer of ``export.max_shard_size``).
    Each side (device, host) of a phase has its terms and a ``total``. On CUDA the host side also holds the
    host runtime per rank (``CUDA_HOST_RUNTIME_BYTES``: interpreter, torch, CUDA's host libraries); with
    ``hardware.device: cpu`` there is one memory: every term is on the device side, the runtime once,
    nothing is staged, and :func:`rank_bytes` (device + host) is what the rank's peak RSS should be.

The device's memory is ``hardware.memory_gib_per_device``, on CUDA as torch sees a card of that nominal
size (``VISIBLE_GIB``: 79.11 GiB of an 80 GB H100), or what verify_env measured (torch's total).

Host memory per node (``plan()["host"]``): ``parallel.nproc_per_node`` ranks x a rank's host side in each
phase (on CPU, x its whole figure), the worst phase against the training job's ``mem_mb`` when the caller
knows it, else this machine's RAM (binding only when the ranks run here, on CPU).

A phase *fits* when its device total is at most ``1 - HEADROOM`` of the device memory, is *tight* up to
the full memory (a warning), and *does not fit* above it. ``plan()["phases"]`` has every phase, the
verdict is the worst phase's (``plan()["worst_phase"]``, the largest device total): :func:`enforce` raises
naming the phases that do not fit with their terms, and what would make the job fit (the smallest device
count at which every phase fits, checkpointing, shorter sequences, micro-batch 1).

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

from . import compat
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
# What a rank holds before its model: the CUDA context (with NCCL's and cuBLAS's buffers) on CUDA; on CPU the
# resident set of a training rank's process, by transformers major version (the stack), measured as
# /proc/self/status VmRSS after importing torch, transformers, moeflow.train/distributed/checkpoint/modeling
# and the qwen3_moe modelling module and initialising a gloo group (docs/memory-plan.md): 597 MiB on the
# pinned stack (torch 2.3.1+cu121, transformers 4.57.1), 403 MiB on the current one (torch 2.13 CPU, 5.24).
CPU_RANK_RUNTIME_BYTES = {4: 600 * 2**20, 5: 405 * 2**20}
CUDA_RUNTIME_BYTES = 1 * GIB
FP32_BYTES = 4  # FSDP's gradient reduce-scatter (reduce_dtype fp32), and the residual stream with fp32 weights
LOSS_BYTES_PER_LOGIT = 4  # a chunk's fp32 logits, which become their gradient in place (moeflow.linear_loss)
# What torch.cuda reports as a card's total memory, by the nominal size configs and profiles name
# (hardware.memory_gib_per_device): "GPU 0 has a total capacity of 79.11 GiB" on an H100 80GB.
VISIBLE_GIB = {80: 79.11, 24: 23.68}  # H100 / A100 80GB; RTX 4090
# The parameters moeflow holds are fp32 in every layout (loaded in fp32; bf16 is autocast on one device and
# FSDP mixed precision's gathers): the width of the resident state in the load, checkpoint, resume and export phases.
PARAM_BYTES = 4
CUDA_HOST_RUNTIME_BYTES = 3 * GIB  # per rank on a GPU node: interpreter, torch, CUDA's host libraries
PHASES = ("load", "step", "checkpoint", "resume", "export")


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
    return model_type == "gpt_oss" or compat.is_transformers_v5()


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
    """The training settings memory depends on, per rank.

    :meth:`from_settings` reads them from ``moeflow.config.plan_settings``. A job outside a config (a
    benchmark's worker) is constructed with every field, e.g. ``fsdp`` over 2 gloo ranks of one node in fp32::

        shape, params, _ = plan.count_parameters(model_cfg, vocab_size)  # model_cfg: the run's model section
        job = plan.Job(precision="fp32", method="full", micro_batch_size=1, seq_len=256,
                       gradient_checkpointing=False, attn_implementation="sdpa", device="cpu", num_devices=2,
                       expert_parallel=False, lora=config.settings(config.LoraSettings, {}),
                       loss_chunk_tokens=1024, ranks_per_node=2, replicated=False, fsdp_size=None)
        phases = plan.phase_memory(shape, params, job)  # phases["load"]["device"]["total"], ...

    ``num_devices`` is the world size; ``replicated=True`` is ``parallel.strategy: none`` (every rank holds the
    whole model), ``expert_parallel=True`` is ``strategy: ep``, neither is ``fsdp``; ``model.loss_chunk_tokens``
    and ``model.attn_implementation`` as the model section has them (the schema's defaults: 1024, sdpa).
    """

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
    ranks_per_node: int  # the ranks of one host (host memory per node = ranks_per_node x per rank)
    replicated: bool = False  # parallel.strategy: none on several ranks: every rank holds the whole model
    fsdp_size: int | None = None  # parallel.fsdp_size: the ranks that shard the states (None: all of them)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Job:
        """The job of ``moeflow.config.plan_settings``: its ``parallel`` section's layout. A config that names
        no ranks (``parallel`` of one process) but several ``hardware.num_devices`` is a plan on paper: FSDP
        over that many devices of one node."""
        train, hardware, parallel = settings["train"], settings["hardware"], settings["parallel"]
        if train["optimizer"] != "adamw":
            raise PlanError(f"config key 'train.optimizer': the planner knows adamw, got {train['optimizer']!r}")
        on_paper = parallel["nproc_per_node"] * parallel["nnodes"] == 1
        return cls(
            precision=settings["precision"],
            method=train["method"],
            micro_batch_size=int(train["micro_batch_size"]),
            seq_len=int(settings["seq_len"]),
            gradient_checkpointing=bool(train["gradient_checkpointing"]),
            attn_implementation=settings["model"]["attn_implementation"],
            device=hardware["device"],
            num_devices=int(hardware["num_devices"]),
            expert_parallel=parallel["strategy"] == "ep",
            # a full run's settings carry no train.lora: the LoRA suggestion uses the defaults
            lora=config_settings(LoraSettings, train["lora"] or {}),
            loss_chunk_tokens=int(settings["model"]["loss_chunk_tokens"]),
            ranks_per_node=int(hardware["num_devices"] if on_paper else parallel["nproc_per_node"]),
            replicated=parallel["strategy"] == "none" and not on_paper,
            fsdp_size=parallel["fsdp_size"],
        )

    @property
    def strategy(self) -> str:
        """The layout as ``parallel.strategy`` names it."""
        if self.expert_parallel:
            return "ep"
        return "none" if self.replicated or self.num_devices == 1 else "fsdp"

    @property
    def shard_ranks(self) -> int:
        """The ranks the weights, gradients and AdamW states are split over (1: every rank holds them whole)."""
        return 1 if self.strategy == "none" else (self.fsdp_size or self.num_devices)

    @property
    def sharded(self) -> bool:
        """FSDP over the devices: one decoder layer (and the root unit) gathered at a time."""
        return self.shard_ranks > 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"strategy": self.strategy, "shard_ranks": self.shard_ranks}

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
    shards = job.shard_ranks
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
        "runtime": runtime_bytes(job.device),
    }
    out["total"] = sum(out.values())
    return out


def runtime_bytes(device: str) -> int:
    """A rank's fixed overhead: the CUDA context, or on CPU the measured resident set of a training rank's
    imports and gloo group on this stack (``CPU_RANK_RUNTIME_BYTES``)."""
    return CUDA_RUNTIME_BYTES if device == "cuda" else CPU_RANK_RUNTIME_BYTES[compat.transformers_major()]


def trained_parameters(s: Shape, params: ParamCount, job: Job) -> tuple[int, int]:
    """(parameters added to the model, parameters trained): LoRA's adapters and what they train, else (0, all)."""
    if job.method != "lora":
        return 0, params.total
    adapters = lora_count(s, job.lora)
    return adapters.added, adapters.trainable


def resident_state(s: Shape, params: ParamCount, job: Job) -> dict[str, int]:
    """What a rank keeps between steps: its share of the parameters (fp32, frozen ones included) and of
    AdamW's two moments of the trained ones. The gradients are freed after each step."""
    added, trained = trained_parameters(s, params, job)
    return {
        "weights": math.ceil((params.total + added) * PARAM_BYTES / job.shard_ranks),
        "optimizer": math.ceil(trained * ADAM_MOMENT_BYTES / job.shard_ranks),
    }


def uses_fsdp1() -> bool:
    """torch before 2.6 (the pinned stack): moeflow.distributed wraps with FSDP1 (FSDP2's ``fully_shard`` there)."""
    return compat.version_of("torch").release[:2] < (2, 6)


def wrapping_unit_bytes(s: Shape, params: ParamCount, job: Job) -> int:
    """FSDP1 materialises each unit whole (fp32) while it wraps it, before keeping this rank's shard: the
    largest unit (a decoder layer, or the root unit). FSDP2 and transformers 5's expert parallelism
    allocate the shards only."""
    if not job.sharded or job.expert_parallel or not uses_fsdp1():
        return 0
    return max(params.largest_layer, root_unit_parameters(s, params)) * PARAM_BYTES


def phase_memory(s: Shape, params: ParamCount, job: Job) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes per rank in each phase (``PHASES``): ``{phase: {"device": {term: bytes, "total": n}, "host":
    {term: bytes, "total": n}}}``, for the job's layout (``Job.strategy``; the module docstring says what each
    phase holds).

    * load: the rank's share of the weights (read from the safetensors rows it owns), FSDP1's unit while it
      wraps (pinned stack), one tensor's owned rows read into a host buffer on CUDA;
    * step: :func:`memory_per_device`;
    * checkpoint: the resident state (:func:`resident_state`) and, on CUDA, one tensor's shard staged on the host;
    * resume: the resident state (the loaded weights, the optimizer's shards read into), the zero gradients of
      the step that initialises a fresh optimizer's state (``distributed.state_pieces``), one tensor's read buffer;
    * export: the resident state and one whole parameter gathered (all ranks take part), staged on the host on CUDA;
      rank 0 streams each tensor to its shard file (no buffer of ``export.max_shard_size``).

    On CUDA the host side holds the staging buffers and the host runtime (``CUDA_HOST_RUNTIME_BYTES``).
    With ``hardware.device: cpu`` there is one memory: everything is on the device side (the runtime once,
    the measured resident set of a rank), the host side is empty, and a rank's figure is
    :func:`rank_bytes` (device + host: what its peak RSS should be)."""
    state = resident_state(s, params, job)
    # a fresh optimizer's state is initialised by a step on zero gradients (torch.distributed.checkpoint's
    # _init_optim_state, in distributed.state_pieces) before the checkpoint's moments are read into it
    _, trained = trained_parameters(s, params, job)
    zero_gradients = math.ceil(trained * PARAM_BYTES / job.shard_ranks)
    whole = params.largest_tensor * PARAM_BYTES
    owned = math.ceil(whole / job.shard_ranks)
    runtime = {"runtime": runtime_bytes(job.device)}
    step = {k: v for k, v in memory_per_device(s, params, job).items() if k != "total"}
    # phase: (device terms, host copies of device memory: only on CUDA)
    terms = {
        "load": (
            {"weights": state["weights"], "wrapping_unit": wrapping_unit_bytes(s, params, job)},
            {"read_buffer": owned},
        ),
        "step": (step, {}),
        "checkpoint": (state, {"staging_copy": owned}),
        "resume": (state | {"initial_gradients": zero_gradients}, {"read_buffer": owned}),
        "export": (state | {"gathered_tensor": whole}, {"staging_copy": whole}),
    }
    on_cuda = job.device == "cuda"
    out = {}
    for phase, (device, copies) in terms.items():
        device = device if phase == "step" else device | runtime
        host = copies | {"runtime": CUDA_HOST_RUNTIME_BYTES} if on_cuda else {}
        out[phase] = {"device": _with_total(device), "host": _with_total(host)}
    return out


def _with_total(terms: Mapping[str, int]) -> dict[str, int]:
    return dict(terms) | {"total": sum(terms.values())}


def rank_bytes(phase: Mapping[str, Mapping[str, int]]) -> int:
    """One rank's memory in a phase of :func:`phase_memory`: device + host (on CPU, its resident set)."""
    return phase["device"]["total"] + phase["host"]["total"]


def host_per_node_bytes(phase: Mapping[str, Mapping[str, int]], job: Job) -> int:
    """A node's host memory in a phase: ``ranks_per_node`` x a rank's host side (on CPU, its whole figure)."""
    per_rank = rank_bytes(phase) if job.device == "cpu" else phase["host"]["total"]
    return job.ranks_per_node * per_rank


def worst_device_total(s: Shape, params: ParamCount, job: Job) -> int:
    """The largest per-rank device total over the phases: what must fit on one device."""
    return max(phase["device"]["total"] for phase in phase_memory(s, params, job).values())


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


def fits(s: Shape, params: ParamCount, job: Job, memory: int) -> bool:
    """Whether every phase of the job fits on its devices with headroom."""
    return verdict(worst_device_total(s, params, job), memory) == "fits"


def min_devices(s: Shape, params: ParamCount, job: Job, memory: int, limit: int = 1_000_000) -> int | None:
    """The smallest device count at which every phase of the job fits with headroom, or None if no count
    does. More devices help by sharding: a ``strategy: none`` job is counted as FSDP over them."""
    job = dataclasses.replace(job, replicated=False, fsdp_size=None)
    if fits(s, params, dataclasses.replace(job, num_devices=1), memory):
        return 1
    # the step's sharded states give the first count to try (no phase fits before the step does)
    at_two = memory_per_device(s, params, dataclasses.replace(job, num_devices=2))
    sharded = 2 * (at_two["weights"] + at_two["gradients"] + at_two["optimizer"])
    replicated = at_two["total"] - sharded / 2
    room = (1 - HEADROOM) * memory - replicated
    if room <= 0:
        return None
    n = max(2, math.ceil(sharded / room))
    while n <= limit:  # ceil() of the shards (or another phase) can need more: step up until it really fits
        if fits(s, params, dataclasses.replace(job, num_devices=n), memory):
            return n
        n += 1
    return None


def max_seq_len(s: Shape, params: ParamCount, job: Job, memory: int) -> int | None:
    """The longest sequence (at most the job's) that fits on the job's devices, or None."""
    lo, hi = 0, job.seq_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(s, params, dataclasses.replace(job, seq_len=mid), memory):
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
    if job.replicated:
        candidates.append(("parallel.strategy: fsdp", dataclasses.replace(job, replicated=False)))
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
        at = dataclasses.replace(variant, num_devices=devices or variant.num_devices, replicated=False)
        spread = dataclasses.replace(variant, num_devices=max(2, variant.num_devices), replicated=False)
        sharded = memory_per_device(s, params, spread)
        states = sharded["weights"] + sharded["gradients"] + sharded["optimizer"]
        options.append(
            {
                "change": change,
                "unshardable_gib": _gib(sharded["total"] - states),
                "fits_as_is": fits(s, params, variant, memory),
                "min_devices": devices,
                "per_device_gib_at_min_devices": _gib(worst_device_total(s, params, at)) if devices else None,
            }
        )
    return [o for o in options if o["fits_as_is"] or o["min_devices"] or o["change"] == candidates[0][0]]


MEM_MB_SOURCE = "the training job's mem_mb"


def host_limit(env_report: Mapping[str, Any], mem_mb: int | None) -> tuple[int, str]:
    """A node's host memory: the training job's ``mem_mb`` (SLURM megabytes: MiB) when known, else this
    machine's RAM (verify_env report)."""
    if mem_mb:
        return int(mem_mb) * 2**20, MEM_MB_SOURCE
    return device_memory_bytes(env_report, "cpu")


def phase_plans(
    phases: Mapping[str, Mapping[str, Mapping[str, int]]], job: Job, memory: int, host_limit_bytes: int
) -> dict[str, dict[str, Any]]:
    """Each phase of :func:`phase_memory` with its sizes in GiB, its node's host memory and both verdicts."""
    out = {}
    for name, phase in phases.items():
        per_node = host_per_node_bytes(phase, job)
        out[name] = {
            "device_bytes": dict(phase["device"]),
            "host_bytes": dict(phase["host"]),
            "device_gib": {k: _gib(v) for k, v in phase["device"].items()},
            "host_gib": {k: _gib(v) for k, v in phase["host"].items()},
            "rank_bytes": rank_bytes(phase),
            "host_per_node_bytes": per_node,
            "verdict": verdict(phase["device"]["total"], memory),
            "host_verdict": verdict(per_node, host_limit_bytes),
        }
    return out


def worst_phase(phases: Mapping[str, Mapping[str, Any]], key: str) -> str:
    """The phase with the most of ``key`` (``device_bytes``' total, or ``host_per_node_bytes``); the earliest
    on a tie."""
    size = lambda name: phases[name][key]["total"] if key == "device_bytes" else phases[name][key]  # noqa: E731
    return max(phases, key=size)


def host_plan(phases: Mapping[str, Mapping[str, Any]], job: Job, limit: int, source: str) -> dict[str, Any]:
    """A node's host memory in its worst phase against ``limit``."""
    worst = worst_phase(phases, "host_per_node_bytes")
    return {
        "phase": worst,
        "ranks_per_node": job.ranks_per_node,
        "per_node_bytes": {name: phase["host_per_node_bytes"] for name, phase in phases.items()},
        "per_node_gib": {name: _gib(phase["host_per_node_bytes"]) for name, phase in phases.items()},
        "limit_bytes": limit,
        "limit_source": source,
        "verdict": phases[worst]["host_verdict"],
    }


def plan(settings: Mapping[str, Any], env_report: Mapping[str, Any], mem_mb: int | None = None) -> dict[str, Any]:
    """The full plan for one run: parameters, memory per rank in every phase, the worst phase and its
    verdict, what would make it fit, and a node's host memory (against ``mem_mb``, the training job's,
    when given). ``per_device_bytes`` is the step's."""
    shape, params, formula = count_parameters(settings["model"], settings["vocab_size"])
    job = Job.from_settings(settings)
    memory, source = device_memory(settings, env_report)
    limit, limit_source = host_limit(env_report, mem_mb)
    phases = phase_plans(phase_memory(shape, params, job), job, memory, limit)
    worst = worst_phase(phases, "device_bytes")
    result = phases[worst]["verdict"]
    per_device = phases["step"]["device_bytes"]
    out = {
        "model_type": shape.model_type,
        "shape": dataclasses.asdict(shape)
        | {"moe_layers": list(shape.moe_layers), "dense_layers": list(shape.dense_layers)},
        "parameters": params.as_dict()
        | {"formula_total": formula.total, "formula_matches": formula.total == params.total},
        "job": job.as_dict(),
        "device_memory_bytes": memory,
        "device_memory_source": source,
        "per_device_bytes": per_device,
        "per_device_gib": {k: _gib(v) for k, v in per_device.items()},
        "phases": phases,
        "worst_phase": worst,
        "usable_fraction": 1 - HEADROOM,
        "verdict": result,
        "min_devices": min_devices(shape, params, job, memory),
        "suggestions": suggestions(shape, params, job, memory) if result != "fits" else [],
        "host": host_plan(phases, job, limit, limit_source),
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
    sharing = f" (states over {job['shard_ranks']} ranks)" if job["shard_ranks"] > 1 else ""
    worst = p["worst_phase"]
    lines = [
        f"{job['method']} fine-tune of {p['model_type']} with {_count(params['total'])} parameters "
        f"({_count(params['active_per_token'])} active per token), {job['precision']}, micro-batch "
        f"{job['micro_batch_size']} x {job['seq_len']} tokens, gradient checkpointing "
        f"{'on' if job['gradient_checkpointing'] else 'off'}, on {job['num_devices']} x {job['device']} of "
        f"{memory:.1f} GiB ({p['device_memory_source']}), parallel.strategy {job['strategy']}"
        f"{sharing}:",
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
        phases_summary(p["phases"]),
        f"  worst phase {worst}: "
        + ("the step's terms above" if worst == "step" else _terms(p["phases"][worst]["device_bytes"])),
        f"  verdict of the {p['worst_phase']} phase: {p['verdict'].replace('_', ' ')} (usable {usable:.1f} of "
        f"{memory:.1f} GiB, {round(100 * (1 - p['usable_fraction']))}% headroom)",
        host_summary(p["host"], p["phases"]),
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


def _terms(terms: Mapping[str, int]) -> str:
    """``total = term + term ...`` of a phase's side, the zero terms left out."""
    parts = [f"{k.replace('_', ' ')} {_size(v)}" for k, v in terms.items() if k != "total" and v]
    return f"{_size(terms['total'])} = " + " + ".join(parts) if parts else "0"


def phases_summary(phases: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: each phase's device total per rank and, where there is one, its host side per rank."""
    cells = []
    for name, phase in phases.items():
        host = phase["host_bytes"]["total"]
        cells.append(f"{name} {_size(phase['device_bytes']['total'])}" + (f" (host {_size(host)})" if host else ""))
    return "  per rank and phase: " + ", ".join(cells)


def host_summary(host: Mapping[str, Any], phases: Mapping[str, Mapping[str, Any]]) -> str:
    worst = phases[host["phase"]]
    side = worst["host_bytes"] if worst["host_bytes"]["total"] else worst["device_bytes"]
    return (
        f"  host per node, worst phase {host['phase']}: {_size(host['per_node_bytes'][host['phase']])} = "
        f"{host['ranks_per_node']} rank(s) x ({_terms(side)}); "
        f"{host['verdict'].replace('_', ' ')} in {_size(host['limit_bytes'])} ({host['limit_source']})"
    )


def enforce(p: Mapping[str, Any]) -> None:
    """Fail when the job's worst phase does not fit on its devices, or a node's ranks do not fit in its
    host memory (the training job's ``mem_mb``; this machine's RAM when the ranks run here, on CPU), with
    the phase, its terms and the options; warn when either is tight (or the host side exceeds this
    machine's RAM, which is not where GPU ranks run)."""
    worst = p["worst_phase"]
    if p["verdict"] == "does_not_fit":
        refused = {name: phase for name, phase in p["phases"].items() if phase["verdict"] == "does_not_fit"}
        raise PlanError(
            f"the training job does not fit in memory in its {', '.join(refused)} phase(s) (worst: {worst}):\n"
            + "\n".join(f"  {name} per device: {_terms(phase['device_bytes'])}" for name, phase in refused.items())
            + "\n"
            + summary(p)
        )
    host = p["host"]
    binding = host["limit_source"] == MEM_MB_SOURCE or p["job"]["device"] == "cpu"
    if host["verdict"] == "does_not_fit" and binding:
        raise PlanError(
            f"the training job's {host['ranks_per_node']} rank(s) per node do not fit in the host memory of "
            f"{_size(host['limit_bytes'])} ({host['limit_source']}) in its {host['phase']} phase:\n" + summary(p)
        )
    if p["verdict"] == "tight":
        log.warning(
            "the training job fits with less than %d%% headroom in its %s phase:\n%s",
            round(HEADROOM * 100),
            worst,
            summary(p),
        )
    elif host["verdict"] != "fits":
        log.warning(
            "the host memory of a node leaves less than %d%% headroom in the %s phase:\n%s",
            round(HEADROOM * 100),
            host["phase"],
            summary(p),
        )


def render_markdown(p: Mapping[str, Any]) -> str:
    params, mem = p["parameters"], p["per_device_bytes"]
    rows = [f"| {k} | {v:,} |" for k, v in params["by_category"].items()]
    mem_rows = [f"| {k.replace('_', ' ')} | {_size(v)} | {v:,} |" for k, v in mem.items()]
    host = p["host"]
    host_rows = [f"| {k} | {_size(v)} | {v:,} |" for k, v in host["per_node_bytes"].items()]
    host_rows.append(f"| limit ({host['limit_source']}) | {_size(host['limit_bytes'])} | {host['limit_bytes']:,} |")
    phases = p["phases"]
    terms = list(dict.fromkeys(k for phase in phases.values() for k in (*phase["device_bytes"], *phase["host_bytes"])))
    terms = sorted((k for k in terms if k != "total"), key=lambda k: k == "runtime")  # the runtime last

    def cell(phase: Mapping[str, Any], side: str, term: str) -> str:
        return _size(phase[side][term]) if phase[side].get(term) else ""

    def row(label: str, cells: Any) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    phase_rows = [
        row(f"{side.split('_')[0]}: {k.replace('_', ' ')}", (cell(ph, side, k) for ph in phases.values()))
        for side in ("device_bytes", "host_bytes")
        for k in terms
        if any(ph[side].get(k) for ph in phases.values())
    ]
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
                f"## Memory per rank and phase (worst: {p['worst_phase']})",
                "",
                row("term", phases),
                "|---|" + "---|" * len(phases),
                *phase_rows,
                row("**device total**", (_size(ph["device_bytes"]["total"]) for ph in phases.values())),
                row("**host total**", (_size(ph["host_bytes"]["total"]) for ph in phases.values())),
                row("verdict", (ph["verdict"].replace("_", " ") for ph in phases.values())),
                "",
                "## Memory per device, step",
                "",
                "| component | size | bytes |",
                "|---|---|---|",
                *mem_rows,
                "",
                f"## Host memory per node by phase ({host['ranks_per_node']} rank(s); worst: {host['phase']})",
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
