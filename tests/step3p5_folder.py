"""A tiny Step-3.5-Flash folder in the published layout, written by hand (not by moeflow or transformers): the
published config's legacy keys (``moe_num_experts``, ``attention_other_setting``, ``moe_layers_enum``, per-layer
lists with the MTP layers' entries), stacked ``moe.*`` expert tensors, ``moe.router_bias`` in float32,
``share_expert.*``, MTP layers as ``model.layers.<n + i>.*`` and, when asked, its own tokenizer with a chat
template. The real model's features are on at a tiny size: 4 query heads on sliding layers and 2 on full ones,
sliding windows 3:1 with full layers, partial rotary on full layers, head-wise attention gates, SwiGLU
limits, routed scaling 3.0, a shared expert, a dense first layer and 2 MTP layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS_FULL, HEADS_SLIDING, KV_HEADS, HEAD_DIM = 32, 2, 4, 1, 16
LAYERS, MTP, EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN, DENSE_FFN = 4, 2, 8, 2, 16, 16, 64
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] + [
    "sliding_attention"
] * MTP
MOE_LAYERS = (1, 2, 3)  # layer 0 dense, as are the MTP layers


def published_config(
    vocab_size: int, bos: int = 0, eos: list[int] | None = None, experts: int = EXPERTS, expert_ffn: int = EXPERT_FFN
) -> dict:
    """The published config.json's keys at the tiny size (48-entry lists become LAYERS + MTP entries), the
    routed experts' number and width as asked (the load-memory test makes them dominate the folder)."""
    full = [t == "full_attention" for t in LAYER_TYPES]
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS_FULL,
        "num_attention_groups": KV_HEADS,
        "head_dim": HEAD_DIM,
        "att_impl_type": "GQA",
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": HEADS_SLIDING,
            "num_attention_groups": KV_HEADS,
            "head_dim": HEAD_DIM,
            "true_head_dim": HEAD_DIM,
        },
        "use_head_wise_attn_gate": True,
        "layer_types": LAYER_TYPES,
        "sliding_window": 8,
        "rope_theta": [5000000.0 if f else 10000.0 for f in full],
        "partial_rotary_factors": [0.5 if f else 1.0 for f in full],
        "moe_num_experts": experts,
        "moe_top_k": TOP_K,
        "moe_intermediate_size": expert_ffn,
        "share_expert_dim": SHARED_FFN,
        "moe_layers_enum": ",".join(str(i) for i in MOE_LAYERS),
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "norm_expert_weight": True,
        "swiglu_limits": [0.0, 0.0, 0.0, 7.0] + [0.0] * MTP,
        "swiglu_limits_shared": [0.0, 0.0, 0.0, 16.0] + [0.0] * MTP,
        "num_nextn_predict_layers": MTP,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos if eos is not None else [1, 2],
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }


def published_tensors(
    vocab_size: int, seed: int = 0, experts: int = EXPERTS, expert_ffn: int = EXPERT_FFN
) -> dict[str, torch.Tensor]:
    """Every tensor of the published layout (names and shapes as the published checkpoint has them)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    h, out = HIDDEN, {}
    out["model.embed_tokens.weight"] = rand(vocab_size, h)
    out["lm_head.weight"] = rand(vocab_size, h)
    out["model.norm.weight"] = rand(h, scale=0.1)
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        heads = HEADS_SLIDING if kind == "sliding_attention" else HEADS_FULL
        out[p + "input_layernorm.weight"] = rand(h, scale=0.1)
        out[p + "post_attention_layernorm.weight"] = rand(h, scale=0.1)
        out[p + "self_attn.q_proj.weight"] = rand(heads * HEAD_DIM, h)
        out[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, h)
        out[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, h)
        out[p + "self_attn.o_proj.weight"] = rand(h, heads * HEAD_DIM)
        out[p + "self_attn.g_proj.weight"] = rand(heads, h)
        out[p + "self_attn.q_norm.weight"] = rand(HEAD_DIM, scale=0.1)
        out[p + "self_attn.k_norm.weight"] = rand(HEAD_DIM, scale=0.1)
        if i in MOE_LAYERS:
            out[p + "moe.gate.weight"] = rand(experts, h, scale=0.5)
            out[p + "moe.router_bias"] = ((torch.rand(experts, generator=g) - 0.5) * 0.2).float()
            out[p + "moe.gate_proj.weight"] = rand(experts, expert_ffn, h)
            out[p + "moe.up_proj.weight"] = rand(experts, expert_ffn, h)
            out[p + "moe.down_proj.weight"] = rand(experts, h, expert_ffn)
            for name, shape in (
                ("gate_proj", (SHARED_FFN, h)),
                ("up_proj", (SHARED_FFN, h)),
                ("down_proj", (h, SHARED_FFN)),
            ):
                out[p + f"share_expert.{name}.weight"] = rand(*shape)
        else:
            for name, shape in (
                ("gate_proj", (DENSE_FFN, h)),
                ("up_proj", (DENSE_FFN, h)),
                ("down_proj", (h, DENSE_FFN)),
            ):
                out[p + f"mlp.{name}.weight"] = rand(*shape)
        if i >= LAYERS:  # an MTP layer
            for name in ("enorm", "hnorm"):
                out[p + f"{name}.weight"] = rand(h, scale=0.1)
            out[p + "eh_proj.weight"] = rand(h, 2 * h)
            out[p + "shared_head.norm.weight"] = rand(h, scale=0.1)
            out[p + "shared_head.output.weight"] = rand(vocab_size, h)
    return out


def write_published_folder(
    folder: Path,
    vocab_size: int,
    tokenizer=None,
    seed: int = 0,
    shards: int = 2,
    experts: int = EXPERTS,
    expert_ffn: int = EXPERT_FFN,
) -> Path:
    """The folder: config.json, ``shards`` safetensors files with model.safetensors.index.json, the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = {} if tokenizer is None else {"bos": tokenizer.bos_token_id, "eos": [tokenizer.eos_token_id]}
    sizes = {"experts": experts, "expert_ffn": expert_ffn}
    (folder / "config.json").write_text(json.dumps(published_config(vocab_size, **ids, **sizes), indent=2))
    tensors = published_tensors(vocab_size, seed, **sizes)
    names = sorted(tensors)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for k, part in enumerate(parts, start=1):
        file = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files by its stored name (an index and its shards, or one file)."""
    from safetensors import safe_open

    from moeflow.model.safetensors_files import weight_files

    out = {}
    for name, file in weight_files(folder).items():
        with safe_open(str(file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out
