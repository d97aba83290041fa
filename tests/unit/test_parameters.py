"""moeflow.model.parameters: one classification of parameter names, and the optimizer groups built on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import FAMILIES, TRANSFORMERS_5_ONLY, build_family

from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.model import parameters as P
from moeflow.model.routing import adapter_for
from moeflow.runtime import compat
from moeflow.train.param_groups import param_groups

STACK_FAMILIES = [f for f in FAMILIES if compat.is_transformers_v5() or f not in TRANSFORMERS_5_ONLY]


def settings(**kw):
    """What param_groups reads of the training settings."""
    return SimpleNamespace(**{"weight_decay": 0.1, "router_lr_multiplier": 1.0, "freeze_router": False, **kw})


def router_parameter_names(model) -> set[str]:
    """The router parameters as moeflow.model.routing finds the routers (not from names)."""
    return {f"{site.name}.{name}" for site in adapter_for(model).sites for name, _ in site.router.named_parameters()}


def group_of(groups, model) -> dict[str, dict]:
    by_id = {id(p): g for g in groups for p in g["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}


@pytest.mark.parametrize("family", STACK_FAMILIES)
def test_every_router_parameter_is_classified_router_and_nothing_else(family):
    model = build_family(family, dtype=torch.float32)
    routers = router_parameter_names(model)
    assert routers
    mtp = mtp_prefixes(model)  # carried MTP layers: named as decoder layers, never routed (tests/unit/test_mtp.py)
    for name, _ in model.named_parameters():
        if not is_mtp_name(name, mtp):
            assert (P.category(name) == P.ROUTER) == (name in routers), name


def test_granitemoe_router_gets_the_router_multiplier_and_freezes():
    # transformers 4.57 names it block_sparse_moe.router.layer.weight (a child Linear), 5 router.weight
    model = build_family("granitemoe", dtype=torch.float32)
    routers = router_parameter_names(model)
    groups = group_of(param_groups(model, settings(router_lr_multiplier=0.25)), model)
    assert {n for n, g in groups.items() if g["lr_multiplier"] == 0.25} == routers
    param_groups(model, settings(freeze_router=True))
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == routers


def test_gpt_oss_expert_biases_take_no_weight_decay():
    model = build_family("gpt_oss", dtype=torch.float32)
    biases = [n for n, p in model.named_parameters() if n.endswith(("gate_up_proj_bias", "down_proj_bias"))]
    assert biases and all(model.get_parameter(n).ndim == 2 for n in biases)
    assert {P.category(n) for n in biases} == {P.EXPERT_BIASES}
    groups = group_of(param_groups(model, settings()), model)
    for name, p in model.named_parameters():
        decayed = groups[name]["weight_decay"] > 0
        assert decayed == (p.ndim >= 2 and name not in biases), name


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("model.layers.1.mlp.gate.weight", P.ROUTER),
        ("base_model.model.model.layers.1.mlp.gate.base_layer.weight", P.ROUTER),
        ("base_model.model.model.layers.1.mlp.gate.lora_A.default.weight", P.ROUTER),
        ("model.layers.1.block_sparse_moe.router.layer.weight", P.ROUTER),
        ("model.layers.1.mlp.experts.3.up_proj.weight", P.ROUTED_EXPERTS),
        ("base_model.model.model.layers.1.mlp.experts.lora_B.default.weight", P.ROUTED_EXPERTS),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", P.EXPERT_BIASES),
        ("model.layers.1.mlp.gate.e_score_correction_bias", P.CORRECTION_BIAS),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", P.SHARED_EXPERTS),
        ("model.layers.1.mlp.shared_expert_gate.weight", P.SHARED_EXPERT_GATE),
        ("model.layers.1.self_attn.q_norm.weight", P.ATTENTION),
        ("model.layers.0.mlp.gate_proj.weight", P.DENSE_FFN),
        ("model.layers.0.post_attention_layernorm.weight", P.NORMS),
        ("model.norm.weight", P.NORMS),
        ("model.embed_tokens.weight", P.EMBEDDING),
        ("lm_head.weight", P.LM_HEAD),
    ],
)
def test_categories_of_names_on_both_layouts_and_under_peft(name, category):
    assert P.category(name) == category


def test_counts_merge_the_small_categories():
    assert P.counted_category("model.layers.1.mlp.experts.down_proj_bias") == P.ROUTED_EXPERTS
    assert P.counted_category("model.layers.1.mlp.gate.e_score_correction_bias") == P.ROUTER
    assert P.counted_category("model.layers.1.mlp.shared_expert_gate.weight") == P.SHARED_EXPERTS
    assert P.counted_category("model.layers.1.unknown.thing") is None


def test_weight_decay_rule_uses_the_shape_in_the_model():
    # FSDP1 flattens parameters to 1-D: the rule reads the original shape (moeflow.parallel.layouts.original_shape)
    assert P.takes_weight_decay("model.layers.0.self_attn.q_proj.weight", (16, 16))
    assert not P.takes_weight_decay("model.layers.0.self_attn.q_proj.bias", (16,))
    assert not P.takes_weight_decay("model.layers.0.self_attn.sinks", (2,))
    assert not P.takes_weight_decay("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 64))


def test_active_parameters_count_top_k_of_the_routed_experts_and_every_other_parameter():
    from tiny_models import tiny_dense_cfg, tiny_model_cfg

    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed
    from moeflow.train.metrics import active_parameters

    moe = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=64, seed=0)
    sizes = {name: p.numel() for name, p in moe.named_parameters()}
    experts = sum(n for name, n in sizes.items() if P.counted_category(name) == P.ROUTED_EXPERTS)
    config = moe.config
    assert experts and config.num_experts_per_tok < config.num_experts
    want = sum(sizes.values()) - experts + experts * config.num_experts_per_tok // config.num_experts
    assert P.active_per_token(config, sizes) == want == active_parameters(moe)  # the Trainer's door, same count
    dense = make_model(typed(ModelSettings, tiny_dense_cfg()), vocab_size=64, seed=0)
    assert P.active_per_token(dense.config, {n: p.numel() for n, p in dense.named_parameters()}) == sum(
        p.numel() for p in dense.parameters()
    )


@pytest.mark.parametrize("tied", [True, False])
def test_the_mfu_counts_no_embedding_lookup_and_a_tied_head_once(tied):
    """Counted by hand for tiny_model_cfg (hidden 32, 2 heads of 16, 1 KV head, 4 experts of 16, top-2, vocab
    64): the input embedding is a lookup, not a matmul; the head (tied or not) is one 64x32 matmul."""
    from tiny_models import tiny_model_cfg

    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed
    from moeflow.train.metrics import flop_bearing_parameters

    model = make_model(typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=tied)), vocab_size=64, seed=0)
    attention = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 16 + 16  # q, k, v, o projections, q and k norms
    layer_norms = 32 + 32
    router = 32 * 4
    active_experts = 2 * 3 * 32 * 16  # top-2 of 4 experts, each gate, up and down of 32x16
    head = 64 * 32
    want = 2 * (attention + layer_norms + router + active_experts) + 32 + head  # final norm, the head
    assert flop_bearing_parameters(model) == want
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert P.active_per_token(model.config, sizes) == want + (0 if tied else 64 * 32)  # the embedding's table
