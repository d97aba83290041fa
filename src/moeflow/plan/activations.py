"""The activations a training step keeps for its backward pass, per device: the planner's activation terms.

moeflow.plan.memory's docstring says what each term holds; moeflow.plan.forward reuses the per-layer count for the
forward-only stages.
"""

from __future__ import annotations

from typing import Any

from moeflow.families import registry
from moeflow.model.settings import LoraSettings
from moeflow.plan.counts import lora_activation_elements
from moeflow.plan.shapes import Shape
from moeflow.runtime import compat

# ``job`` below is a moeflow.plan.memory.Job (moeflow.plan.memory imports this module)
Job = Any

WEIGHT_BYTES = {"fp32": 4, "bf16": 2}


FP32_BYTES = 4  # FSDP's gradient reduce-scatter (reduce_dtype fp32), and the residual stream with fp32 weights


LOSS_BYTES_PER_LOGIT = 4  # a chunk's fp32 logits, which become their gradient in place (moeflow.model.chunked_loss)


def layer_activation_elements(
    s: Shape, seq_len: int, eager: bool, moe: bool, lora: LoraSettings | None = None, heads: int | None = None
) -> int:
    """Elements kept for the backward pass per token by one decoder layer with ``heads`` query heads (the
    shape's ``num_heads`` if not given; module docstring)."""
    h = s.hidden_size
    heads = s.num_heads if heads is None else heads
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        qkv = (s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_rope_head_dim
        qkv += heads * (2 * qk_head + s.qk_nope_head_dim + s.v_head_dim)
        attn_out = heads * s.v_head_dim
    else:
        qkv = (heads + 2 * s.num_kv_heads) * s.head_dim
        attn_out = heads * s.head_dim
    attention = 2 * h + qkv + attn_out + heads + s.head_gate * heads + (heads * seq_len if eager else 0)
    ffn_in = 2 * h  # residual into the second norm, and the norm's output
    if moe:
        ffn = 2 * s.num_experts + s.top_k * (2 * h + 3 * s.expert_ffn) + (3 * s.shared_ffn + h if s.shared_ffn else 0)
    else:
        ffn = 3 * s.dense_ffn
    return attention + ffn_in + ffn + (lora_activation_elements(s, lora, moe, heads) if lora else 0)


def kept_layer_inputs(s: Shape, job: Job) -> int:
    """Residual-stream tensors kept per token for the backward pass: each layer's input with gradient
    checkpointing (what the recomputation starts from), its input and its residual after attention without."""
    return s.num_layers * s.hidden_size * (1 if job.gradient_checkpointing else 2)


def residual_stream_bytes(s: Shape, job: Job) -> int:
    """The kept residual stream, in fp32 where the weights are fp32 (fp32, or bf16 autocast on one device:
    the embedding's output and the residual additions stay fp32), in bf16 under FSDP mixed precision and where
    the weights are held in bf16 (LoRA's frozen base: the embedding's output is bf16)."""
    bf16_weights = job.mixed_precision or (job.method == "lora" and job.precision == "bf16")
    width = WEIGHT_BYTES[job.precision] if bf16_weights else FP32_BYTES
    return job.micro_batch_size * job.seq_len * kept_layer_inputs(s, job) * width


def activation_bytes(s: Shape, job: Job) -> int:
    """The decoder layers' other kept tensors, in the compute width (the residual stream and the loss
    are their own terms)."""
    tokens = job.micro_batch_size * job.seq_len
    width = WEIGHT_BYTES[job.precision]
    eager = job.attn_implementation == "eager"
    lora = job.lora if job.method == "lora" else None
    moe_set = set(s.moe_layers)
    layers = [
        layer_activation_elements(s, job.seq_len, eager, i in moe_set, lora, s.heads(i)) for i in range(s.num_layers)
    ]
    if job.gradient_checkpointing:  # one layer recomputed at a time, from its kept input
        per_token = max(layers) - s.hidden_size
    else:
        per_token = sum(layers) - kept_layer_inputs(s, job)
    per_token += 2 * s.hidden_size  # final norm
    return tokens * per_token * width


def attention_mask_bytes(s: Shape, job: Job) -> int:
    """The attention masks of a forward with sdpa or eager attention, held for the whole step (every checkpointed
    layer takes them as an input): one ``[micro-batch, 1, L, L]`` mask per attention type (full, sliding window),
    booleans where transformers 5 builds them for sdpa from the packed rows' positions, additive float masks
    (counted at float32) where it builds them for eager attention and where moeflow.data.collate builds them
    (transformers 4.57, and the families whose record says ``masks_without_positions_v5``). flash-attn builds
    none."""
    if job.attn_implementation == "flash_attention_2":
        return 0
    boolean = (
        job.attn_implementation == "sdpa"
        and compat.is_transformers_v5()
        and not registry.FAMILIES[s.model_type].masks_without_positions_v5
    )
    return job.micro_batch_size * job.seq_len**2 * s.attention_masks * (1 if boolean else FP32_BYTES)


def loss_bytes(s: Shape, job: Job) -> int:
    """The chunked cross-entropy (moeflow.model.chunked_loss): one chunk's logits, ``LOSS_BYTES_PER_LOGIT`` per
    token and vocabulary entry plus, with bf16, the product before its fp32 copy and the gradient's bf16
    copy; and the fp32 gradients it computes in the forward pass and keeps for the backward pass."""
    tokens = job.micro_batch_size * job.seq_len
    chunk = min(job.loss_chunk_tokens, tokens)
    width = WEIGHT_BYTES[job.precision]
    per_logit = LOSS_BYTES_PER_LOGIT + (width if width < FP32_BYTES else 0)
    output_trains = job.method == "full" or (job.method == "esft" and job.esft.train_non_expert)
    kept = tokens * (s.hidden_size + 1) + (s.vocab_size * s.hidden_size if output_trains else 0)
    return chunk * s.vocab_size * per_logit + kept * FP32_BYTES
