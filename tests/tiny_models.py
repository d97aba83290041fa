"""Tiny models of every supported MoE family with each family's distinctive features on, shared by the tests.

Sliding windows where the family has them (mixed sliding/full layers for gpt_oss, qwen2_moe on transformers 5
and step3p5), shared experts, dense first layers, group-limited routing, correction biases of both signs,
expert and router biases (gpt_oss), tied and untied embeddings, step3p5's per-layer-type head counts, partial
rotary, SwiGLU clamps, routed scaling and MTP layers. ``build_family`` gives a model in float64 on
the CPU (eager experts on transformers 5: grouped_mm rejects float64 on the CPU).
"""

from __future__ import annotations

import torch

from moeflow.families import registry
from moeflow.loading.factory import make_model
from moeflow.model.routing import adapter_for
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.settings import typed

VOCAB = 128
SEQ = 32
WINDOW = 8  # sliding window, well under SEQ so that it matters
COMMON = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}

FAMILY_CONFIGS = {
    "qwen2_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
    },
    "qwen3_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
    },
    "mixtral": {
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
    },
    "olmoe": {
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "deepseek_v3": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,  # the published MTP layer (MoE, its own embedding and head), on both stacks
    },
    # layer_types alternate sliding/full by default; experts and router carry biases
    "gpt_oss": {
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": WINDOW,
    },
    "granitemoe": {
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": True,
    },
    # The published model's features (moeflow.families.step3p5): 4 query heads on sliding layers and 2 on
    # full ones, sliding:full 3:1, partial rotary and another rope theta on full layers, head-wise attention
    # gates (on by default), SwiGLU clamps that bite at this size (routed and shared), routed scaling 3.0, a
    # shared expert, a dense first layer, and 2 MTP layers (per-layer lists carry their entries, as published).
    "step3p5": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "share_expert_dim": 16,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "num_sliding_attention_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_router_scaling_factor": 3.0,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "dense", "dense"],
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2,
        "rope_theta": [10000.0] * 3 + [5000000.0] + [10000.0] * 2,
        "partial_rotary_factors": [1.0] * 3 + [0.5] + [1.0] * 2,
        "swiglu_limits": [0.0, 0.0, 0.05, 0.05, 0.0, 0.0],
        "swiglu_limits_shared": [0.0, 0.0, 0.05, 0.05, 0.0, 0.0],
        "num_nextn_predict_layers": 2,
    },
}
FAMILIES = tuple(FAMILY_CONFIGS)
TRANSFORMERS_5_ONLY = registry.CURRENT_STACK_ONLY  # refused on the pinned stack, naming the current one
MOE_LAYERS = {"deepseek_v3": [1, 2], "step3p5": [1, 2, 3]}  # the others: [0, 1]


# Tests build models outside a stage, without a measured choice: eager experts (transformers 4.57's only loop;
# on transformers 5, grouped_mm rejects float64 on the CPU).
TEST_EXPERTS = "eager"


def model_config(model_type: str, attn: str = "eager") -> dict:
    """The ``model`` config section (``moeflow.model.settings.ModelSettings``) of a family's tiny model."""
    return {
        "attn_implementation": attn,
        "experts_implementation": TEST_EXPERTS,
        "config": {"model_type": model_type, **COMMON, **FAMILY_CONFIGS[model_type]},
    }


def folder_settings(**keys) -> ModelSettings:
    """The model settings a test loads a saved folder with, as from_pretrained would: the stack's own experts
    implementation, the schema's defaults for the rest (``model.config`` is not read for a folder)."""
    return typed(ModelSettings, {"config": {}, "experts_implementation": STACK_DEFAULT_EXPERTS, **keys})


def build_family(model_type: str, attn: str = "eager", dtype: torch.dtype = torch.float64, seed: int = 0):
    """A family's tiny model in ``dtype``, in eval mode, with routers spread far from ties."""
    model = make_model(typed(ModelSettings, model_config(model_type, attn)), vocab_size=VOCAB, seed=seed)
    model = model.to(dtype)
    spread_routers(model, seed)
    return model.eval()


def spread_routers(model, seed: int = 0) -> None:
    """Router weights large enough that selections are far from ties, and correction biases of both signs, so
    that the sigmoid routers' biased, group-limited choice differs from a plain top-k of the logits."""
    generator = torch.Generator().manual_seed(seed + 1)
    for site in adapter_for(model).sites:
        weight = site.weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float64) * 0.5)
            bias = getattr(site.router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_((torch.rand(bias.shape, generator=generator, dtype=torch.float64) - 0.5) * 0.8)


def tiny_model_cfg(attn: str = "sdpa", **config):
    """The model section of a tiny qwen3_moe (2 layers, 4 experts, top-2) that the training tests share;
    ``config`` overrides its ``model.config`` keys."""
    return {
        "attn_implementation": attn,
        "experts_implementation": TEST_EXPERTS,
        "config": {
            "model_type": "qwen3_moe",
            "hidden_size": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
            **config,
        },
    }


def tiny_dense_cfg(attn: str = "sdpa", **config):
    """``tiny_model_cfg``'s model without experts: every layer a dense MLP."""
    return tiny_model_cfg(attn, **{"num_experts": 0, "intermediate_size": 32, **config})
