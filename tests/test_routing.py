"""Routing telemetry against a hand reference from the router's own weights, for every family, per stack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow import compat
from moeflow.modeling import build_model
from moeflow.routing import SIGMOID, UnsupportedModel, adapter_for, capture

VOCAB = 128
TOKENS = (2, 24)  # batch, seq
COMMON = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}

# Tiny configs; each family's selection rule is written out by hand in `reference_routing`.
FAMILY_CONFIGS = {
    "qwen2_moe": {"intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                  "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "qwen3_moe": {"intermediate_size": 64, "moe_intermediate_size": 16, "head_dim": 16, "num_hidden_layers": 2,
                  "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 16, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 16, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
              "norm_topk_prob": False},
    "deepseek_v3": {"intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
                    "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                    "topk_group": 2, "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 8, "num_key_value_heads": 2},
    "gpt_oss": {"intermediate_size": 16, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                "head_dim": 16, "sliding_window": 8},
    "granitemoe": {"intermediate_size": 16, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "step3p5": {"intermediate_size": 64, "moe_intermediate_size": 16, "share_expert_dim": 16, "head_dim": 16,
                "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "mlp_layer_types": ["dense", "sparse", "sparse"], "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
}
MOE_LAYERS = {"deepseek_v3": [1, 2], "step3p5": [1, 2]}


def build_family(model_type: str, seed: int = 0):
    fields = {"model_type": model_type, **COMMON, **FAMILY_CONFIGS[model_type]}
    if model_type == "step3p5":
        # Step-3.5's text model has no causal-LM auto class; transformers 5 ships it inside step3p7.
        compat.require_transformers_v5("step3p5")
        from transformers import AutoConfig
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        fields.pop("model_type")
        torch.manual_seed(seed)
        model = Step3p7TextModel(AutoConfig.for_model("step3p5", vocab_size=VOCAB, **fields))
    else:
        model = build_model({"config": fields, "attn_implementation": "eager"}, vocab_size=VOCAB, seed=seed)
    # Spread router weights (and correction biases) so selections are far from ties, and so that the
    # sigmoid routers' biased, group-limited choice differs from a plain top-k of the logits.
    generator = torch.Generator().manual_seed(seed + 1)
    for site in adapter_for(model).sites:
        weight = site.weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
            bias = getattr(site.router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=generator) * 0.4)
    return model.eval()


def reference_routing(model_type: str, site, hidden: torch.Tensor):
    """logits = h @ W^T (+ b), then the family's selection rule, from the router's parameters alone."""
    router = site.router
    h = hidden.reshape(-1, hidden.shape[-1]).float()
    logits = h @ site.weight.float().T
    if model_type == "gpt_oss":
        logits = logits + router.bias.float()
    k = site.top_k
    if model_type in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe"):
        probs = torch.softmax(logits, dim=-1)
        weight, index = probs.topk(k, dim=-1)
        if FAMILY_CONFIGS[model_type].get("norm_topk_prob", True):  # mixtral always renormalises
            weight = weight / weight.sum(-1, keepdim=True)
    elif model_type in ("gpt_oss", "granitemoe"):
        top, index = logits.topk(k, dim=-1)
        weight = torch.softmax(top, dim=-1)
    elif model_type == "deepseek_v3":
        scores = torch.sigmoid(logits)
        biased = scores + router.e_score_correction_bias.float()
        n_group, topk_group = 4, 2
        grouped = biased.view(len(h), n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep_groups = group_score.topk(topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_groups, True)
        allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(len(h), -1)
        index = biased.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
        weight = scores.gather(1, index)
        weight = weight / weight.sum(-1, keepdim=True) * 2.5
    elif model_type == "step3p5":
        scores = torch.sigmoid(logits)
        index = (scores + router.e_score_correction_bias.float()).topk(k, dim=-1).indices
        weight = scores.gather(1, index)
        weight = weight / weight.sum(-1, keepdim=True)
    else:
        raise AssertionError(model_type)
    return logits, index, weight


def sorted_by_expert(index: torch.Tensor, weight: torch.Tensor):
    order = index.argsort(dim=-1)
    return index.gather(1, order), weight.float().gather(1, order)


def family_params() -> list:
    v5_only = pytest.mark.skipif(not compat.is_transformers_v5(), reason="step3p7/step3p5 exists in transformers 5 only")
    return [pytest.param(t, marks=[v5_only] if t == "step3p5" else [], id=t) for t in FAMILY_CONFIGS]


@pytest.mark.parametrize("model_type", family_params())
def test_capture_matches_hand_reference(model_type):
    model = build_family(model_type)
    adapter = adapter_for(model)
    router_inputs = {}
    handles = [
        site.router.register_forward_pre_hook(lambda m, args, layer=site.layer: router_inputs.__setitem__(layer, args[0]))
        for site in adapter.sites
    ]
    input_ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), capture(model) as routing:
        out = model(input_ids=input_ids, use_cache=False, output_router_logits=True)
    for handle in handles:
        handle.remove()

    layers = routing.layers
    assert [r.layer for r in layers] == MOE_LAYERS.get(model_type, [0, 1])
    tokens = TOKENS[0] * TOKENS[1]
    differs_from_plain_topk = False
    for site, record in zip(adapter.sites, layers):
        assert record.num_experts == 8 and record.topk_index.dtype == torch.int64
        assert record.logits.shape == (tokens, 8) and record.topk_index.shape == (tokens, 2)
        logits, index, weight = reference_routing(model_type, site, router_inputs[site.layer])
        torch.testing.assert_close(record.logits.float(), logits, rtol=1e-5, atol=1e-5)
        got_index, got_weight = sorted_by_expert(record.topk_index, record.topk_weight)
        want_index, want_weight = sorted_by_expert(index, weight)
        assert torch.equal(got_index, want_index)
        torch.testing.assert_close(got_weight, want_weight, rtol=1e-5, atol=1e-5)
        probs = record.probs()
        torch.testing.assert_close(probs.sum(-1), torch.ones(tokens))
        plain = sorted_by_expert(logits.topk(2, dim=-1).indices, weight)[0]
        differs_from_plain_topk |= not torch.equal(plain, want_index)
        if record.scoring == SIGMOID:
            torch.testing.assert_close(probs, torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True))
        else:
            torch.testing.assert_close(probs, torch.softmax(logits, -1))
    # The public API's logits, where the model returns them, are the ones captured.
    returned = getattr(out, "router_logits", None)
    if returned:
        assert len(returned) == len(layers)
        for got, record in zip(returned, layers):
            got = got.float().reshape(tokens, -1)
            if model_type == "gpt_oss" and not compat.is_transformers_v5():
                # 4.57's GPT-OSS "router_logits" are its routing scores: softmax over the chosen logits.
                want = torch.zeros_like(got).scatter_(1, record.topk_index, record.topk_weight.float())
                torch.testing.assert_close(got, want)
            else:
                torch.testing.assert_close(got, record.logits.float())
    if model_type in ("deepseek_v3", "step3p5"):
        assert differs_from_plain_topk, "the sigmoid routers' choice must come from the router, not a top-k of logits"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_does_not_double_count(model_type):
    model = build_family(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapter = adapter_for(model)
    calls = []
    handles = [s.router.register_forward_hook(lambda *a, layer=s.layer: calls.append(layer)) for s in adapter.sites]
    input_ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(5))
    with capture(model) as routing:
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        first = [r.topk_index.clone() for r in routing.layers]
        # A balancing loss from the captured probabilities reaches the router weights through the rerun.
        balance = sum(
            (r.probs().mean(0) * torch.bincount(r.topk_index.flatten(), minlength=8).float()).sum()
            for r in routing.layers
        )
        (out.loss + 0.01 * balance).backward()
        after = routing.layers
    for handle in handles:
        handle.remove()
    assert sorted(calls) == sorted(adapter.moe_layers * 2), "the recomputation must have fired the hooks again"
    assert [r.layer for r in after] == adapter.moe_layers
    assert all(site.weight.grad is not None and site.weight.grad.abs().sum() > 0 for site in adapter.sites)
    for before, record in zip(first, after):
        assert torch.equal(before, record.topk_index)
        assert torch.bincount(record.topk_index.flatten(), minlength=8).sum() == TOKENS[0] * TOKENS[1] * 2
    # A second forward starts a fresh record.
    with torch.no_grad(), capture(model) as routing:
        model(input_ids=input_ids[:1], use_cache=False)
        assert [r.topk_index.shape[0] for r in routing.layers] == [TOKENS[1]] * len(adapter.moe_layers)


def test_dense_model_is_a_clear_error():
    cfg = {"model_type": "llama", **COMMON, "intermediate_size": 64, "num_hidden_layers": 1}
    model = build_model({"config": cfg}, vocab_size=VOCAB)
    with pytest.raises(UnsupportedModel, match=r"model_type 'llama'.*dense model.*adapter .* needs"):
        adapter_for(model)


def test_unsupported_moe_family_names_what_an_adapter_needs():
    cfg = {"model_type": "phimoe", **COMMON, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    model = build_model({"config": cfg}, vocab_size=VOCAB)
    with pytest.raises(UnsupportedModel) as err:
        adapter_for(model)
    message = str(err.value)
    assert "'phimoe'" in message and "num_local_experts=4" in message
    assert "class name of the family's MoE block" in message and "qwen3_moe" in message


def test_supported_family_without_moe_layers_is_a_clear_error():
    cfg = {"model_type": "qwen3_moe", **COMMON, **FAMILY_CONFIGS["qwen3_moe"], "mlp_only_layers": [0, 1]}
    model = build_model({"config": cfg}, vocab_size=VOCAB)
    with pytest.raises(UnsupportedModel, match="no Qwen3MoeSparseMoeBlock module found"):
        adapter_for(model)
