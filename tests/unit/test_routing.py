"""Routing telemetry against a hand reference from the router's own weights, for every family, per stack."""

from __future__ import annotations

import family_checks as C
import pytest
import torch
from tiny_models import COMMON, FAMILY_CONFIGS, SEQ, TRANSFORMERS_5_ONLY, VOCAB

from moeflow.loading.factory import make_model
from moeflow.model.routing import NoMoELayers, UnsupportedModel, adapter_for, adapter_or_none, capture
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed

TOKENS = (2, SEQ)  # batch, seq


def family_params() -> list:
    v5_only = pytest.mark.skipif(not compat.is_transformers_v5(), reason="step3p5 exists in transformers 5 only")
    return [pytest.param(t, marks=[v5_only] if t in TRANSFORMERS_5_ONLY else [], id=t) for t in FAMILY_CONFIGS]


@pytest.mark.parametrize("model_type", family_params())
def test_capture_matches_hand_reference(model_type):
    found = C.check_routing(model_type)
    if model_type in ("deepseek_v3", "step3p5"):
        assert found["differs_from_plain_topk"], "the sigmoid routers' choice must come from the router, not a top-k"
    if model_type == "deepseek_v3":
        assert found["differs_without_groups"], "group-limited routing must matter on these inputs"


def test_correction_biases_have_both_signs():
    for model_type in ("deepseek_v3",) + (("step3p5",) if compat.is_transformers_v5() else ()):
        for site in adapter_for(C.build(model_type)).sites:
            bias = site.router.e_score_correction_bias
            assert (bias < 0).any() and (bias > 0).any()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_does_not_double_count(model_type):
    model = C.build(model_type).train()
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
    model = make_model(
        typed(ModelSettings, {"config": cfg, "experts_implementation": STACK_DEFAULT_EXPERTS}), vocab_size=VOCAB
    )
    with pytest.raises(UnsupportedModel, match=r"model_type 'llama'.*dense model.*adapter .* needs"):
        adapter_for(model)


def test_unsupported_moe_family_names_what_an_adapter_needs():
    cfg = {
        "model_type": "phimoe",
        **COMMON,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    model = make_model(
        typed(ModelSettings, {"config": cfg, "experts_implementation": STACK_DEFAULT_EXPERTS}), vocab_size=VOCAB
    )
    with pytest.raises(UnsupportedModel) as err:
        adapter_for(model)
    message = str(err.value)
    assert "'phimoe'" in message and "num_local_experts=4" in message
    assert "class name of the family's MoE block" in message and "qwen3_moe" in message


def test_a_configured_moe_whose_layers_are_all_dense_is_refused():
    """num_experts in the config but no MoE block (every layer in mlp_only_layers): refused, not trained dense."""
    cfg = {"model_type": "qwen3_moe", **COMMON, **FAMILY_CONFIGS["qwen3_moe"], "mlp_only_layers": [0, 1]}
    model = make_model(
        typed(ModelSettings, {"config": cfg, "experts_implementation": STACK_DEFAULT_EXPERTS}), vocab_size=VOCAB
    )
    with pytest.raises(UnsupportedModel, match="no Qwen3MoeSparseMoeBlock module was found") as err:
        adapter_for(model)
    assert not isinstance(err.value, NoMoELayers) and "Qwen3MoeMLP" in str(err.value)


def test_a_renamed_moe_block_is_refused_with_the_class_names_found():
    """A remote-code or renamed MoE block that no adapter matches: every consumer (the trainer, the guards, the
    experts choice, evaluation) is refused, naming the classes found, instead of training the model as dense."""
    model = C.build("qwen3_moe")
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert blocks
    renamed = type("RemoteSparseMoeBlock", (type(blocks[0]),), {})
    for block in blocks:
        block.__class__ = renamed
    for reader in (adapter_for, adapter_or_none):
        with pytest.raises(UnsupportedModel, match="num_experts=8.*RemoteSparseMoeBlock") as err:
            reader(model)
        assert not isinstance(err.value, NoMoELayers)
        assert "no Qwen3MoeSparseMoeBlock module was found" in str(err.value)


def test_a_dense_configuration_of_a_moe_family_has_no_moe_layers():
    """num_experts 0 (the dense run of the default config): no MoE layer, and adapter_or_none says so."""
    cfg = {"model_type": "qwen3_moe", **COMMON, **FAMILY_CONFIGS["qwen3_moe"], "num_experts": 0}
    model = make_model(
        typed(ModelSettings, {"config": cfg, "experts_implementation": STACK_DEFAULT_EXPERTS}), vocab_size=VOCAB
    )
    with pytest.raises(NoMoELayers, match="Qwen3MoeMLP"):
        adapter_for(model)
    assert adapter_or_none(model) is None
