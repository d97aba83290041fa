"""LoRA through peft: targets on both stacks' expert layouts, clear errors, gradients under checkpointing,
adapter-only save/load and resume, merge equivalence, router modes."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import folder_settings

from moeflow.checkpoint.export import save_final_model
from moeflow.loading.factory import make_model
from moeflow.model import lora, routing
from moeflow.model.activation_checkpointing import enable_activation_checkpointing
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.plan.counts import count_parameters, lora_count
from moeflow.runtime import compat
from moeflow.settings import ConfigError, typed
from moeflow.train.settings import LoraSettings, TrainSettings
from moeflow.workflow.keys import plan_settings, train_settings, training, warmup_key
from moeflow.workflow.load import load

VOCAB = 100
SMALL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
}
FAMILIES = {
    "qwen3_moe": {"head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
        "num_key_value_heads": 4,
    },
    "gpt_oss": {
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["full_attention", "sliding_attention"],
    },
}
V5 = compat.is_transformers_v5()


def section(name: str, **config) -> dict:
    return {
        "config": {"model_type": name, **SMALL, **FAMILIES[name], **config},
        "attn_implementation": "eager",
        "experts_implementation": STACK_DEFAULT_EXPERTS,
    }


def tiny(name: str = "qwen3_moe", seed: int = 0):
    return make_model(typed(ModelSettings, section(name)), vocab_size=VOCAB, seed=seed)


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def perturb_adapters(model, seed: int = 2) -> None:
    """Give the adapters non-zero weights (peft starts lora_B at zero, so they would do nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def logits(model, x) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


# --------------------------------------------------------------------------- settings


def lora_of(section: dict) -> LoraSettings:
    """``train.lora`` settings: the keys given, the schema's defaults for the rest."""
    return typed(LoraSettings, section)


def test_settings_resolve_all_and_name_the_bad_key():
    settings = lora_of({"rank": 8, "alpha": 16, "targets": ["all"]})
    assert (
        settings.categories == ("attention", "dense_ffn", "shared_experts", "routed_experts")
        and settings.router == "frozen"
    )
    assert lora_of({"targets": ["attention"]}).categories == ("attention",)
    for bad, where in (
        ({"targets": ["experts"]}, r"train\.lora\.targets\[0\]': 'experts'"),
        ({"router": "unfrozen"}, r"train\.lora\.router"),
        ({"r": 8}, r"train\.lora': unknown key\(s\) 'r'"),
    ):
        with pytest.raises(ConfigError, match=where):
            load(overrides={"train": {"lora": bad}})


def test_config_schema_checks_train_lora():
    cfg = load(overrides={"train": {"method": "lora", "lora": {"router": "adapter"}}})
    assert typed(TrainSettings, train_settings(cfg)).lora.router == "adapter"
    with pytest.raises(ConfigError, match="unfrozen"):
        load(overrides={"train": {"lora": {"router": "unfrozen"}}})


# --------------------------------------------------------------------------- where adapters go


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_all_targets_adapt_attention_and_every_expert_and_freeze_the_rest(name):
    model = lora.apply_lora(tiny(name), lora_of({"rank": 4, "targets": ["all"]}), gradient_checkpointing=False)
    report = lora.trainable_parameter_report(model)
    adapted = {k for k, v in report["by_category"].items() if v["trainable"]}
    expected = {"attention", "routed_experts"} | ({"shared_experts", "dense_ffn"} if name == "deepseek_v3" else set())
    assert adapted == expected
    assert report["trainable"] == report["adapter"] > 0 and not report["router_trainable"]
    targets = lora.find_targets(tiny(name), lora_of({"rank": 4}))
    if V5:  # fused 3D experts: peft's target_parameters, one adapter per expert inside
        assert set(targets.parameters.values()) == {"routed_experts"} and all(
            k.endswith(("gate_up_proj", "down_proj")) for k in targets.parameters
        )
    else:  # separate nn.Linear per expert: target_modules
        assert not targets.parameters
        moe_layers = 1 if name == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense (first_k_dense_replace)
        assert (
            sum(c == "routed_experts" for c in targets.modules.values()) == moe_layers * 4 * 3
        )  # x experts x gate/up/down
    for param_name, param in model.named_parameters():
        if "lora_" not in param_name:
            assert not param.requires_grad, param_name
    assert torch.equal(logits(model, inputs()), logits(tiny(name), inputs()))  # lora_B starts at zero


def test_targets_that_the_model_lacks_are_named():
    with pytest.raises(lora.LoraConfigError, match=r"train\.lora\.targets.*no shared_experts"):
        lora.apply_lora(tiny("qwen3_moe"), lora_of({"targets": ["shared_experts"]}), False)
    dense = make_model(typed(ModelSettings, section("qwen3_moe", num_experts=0)), vocab_size=VOCAB)
    with pytest.raises(lora.LoraConfigError, match=r"train\.lora\.router.*no router"):
        lora.apply_lora(dense, lora_of({"targets": ["all"], "router": "trainable"}), False)
    model = lora.apply_lora(dense, lora_of({"targets": ["all"]}), False)  # a dense model: attention and its MLPs
    assert set(k for k, v in lora.trainable_parameter_report(model)["by_category"].items() if v["trainable"]) == {
        "attention",
        "dense_ffn",
    }


def test_stack_limits_raise_clear_errors():
    if V5:
        with pytest.raises(lora.LoraConfigError, match=r"train\.lora\.dropout.*target_parameters"):
            lora.apply_lora(tiny("qwen3_moe"), lora_of({"dropout": 0.1, "targets": ["routed_experts"]}), False)
        model = lora.apply_lora(tiny("qwen3_moe"), lora_of({"dropout": 0.1, "targets": ["attention"]}), False)
        assert lora.trainable_parameter_report(model)["trainable"] > 0
        lora.apply_lora(
            tiny("gpt_oss"), lora_of({"rank": 4}), False
        )  # fused experts declared (experts, in, out): fine on 5
    else:
        model = lora.apply_lora(
            tiny("qwen3_moe"), lora_of({"dropout": 0.1}), False
        )  # separate linear experts take dropout
        assert lora.trainable_parameter_report(model)["by_category"]["routed_experts"]["trainable"] > 0
        with pytest.raises(compat.UnsupportedOnStack, match=r"gpt_oss.*fused 3D.*needs transformers 5"):
            lora.apply_lora(tiny("gpt_oss"), lora_of({"rank": 4}), False)
        with pytest.raises(
            compat.UnsupportedOnStack, match=r"train\.lora\.router.*DeepseekV3(Topk)?Router.*needs transformers 5"
        ):
            lora.apply_lora(tiny("deepseek_v3"), lora_of({"rank": 4, "router": "adapter"}), False)
        lora.apply_lora(tiny("gpt_oss"), lora_of({"rank": 4, "targets": ["attention"]}), False)


# --------------------------------------------------------------------------- gradients under checkpointing


def adapter_grads(model, x) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_adapters_get_the_same_gradients_under_non_reentrant_checkpointing():
    plain = lora.apply_lora(tiny(), lora_of({"rank": 4}), gradient_checkpointing=False)
    checkpointed = lora.apply_lora(tiny(), lora_of({"rank": 4}), gradient_checkpointing=True)
    perturb_adapters(plain)
    perturb_adapters(checkpointed)
    base = checkpointed.get_base_model()
    checkpointing = base.is_activation_checkpointing if V5 else base.is_gradient_checkpointing
    assert checkpointing and not base.get_input_embeddings().weight.requires_grad
    expected, got = adapter_grads(plain, inputs()), adapter_grads(checkpointed, inputs())
    trainable = [n for n, p in checkpointed.named_parameters() if p.requires_grad]
    assert sorted(got) == sorted(trainable)  # every adapter, experts included, gets a gradient
    assert all(got[n].abs().sum() > 0 for n in got)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-7)


def test_reentrant_checkpointing_without_input_grads_trains_nothing_on_4_57():
    """What enable_input_require_grads is for: with frozen embeddings the reentrant checkpoint sees no
    input that needs grad, so no layer output carries a graph. transformers 5 turns input grads on
    itself when checkpointing is enabled; 4.57 does so only for adapters it loaded itself."""
    model = lora.apply_lora(tiny(), lora_of({"rank": 4, "targets": ["attention"]}), gradient_checkpointing=False)
    perturb_adapters(model)
    enable_activation_checkpointing(model.get_base_model(), reentrant=True)
    if V5:
        assert all(g.abs().sum() > 0 for g in adapter_grads(model, inputs()).values())
    else:
        with pytest.raises(RuntimeError, match="does not require grad"):
            adapter_grads(model, inputs())
    model.get_base_model().enable_input_require_grads()  # what apply_lora does
    grads = adapter_grads(model, inputs())
    assert len(grads) == 2 * 4 * 2 and all(g.abs().sum() > 0 for g in grads.values())


# --------------------------------------------------------------------------- save, load, resume, merge


@pytest.mark.parametrize(
    "name,router",
    [("qwen3_moe", "frozen"), ("mixtral", "trainable"), ("deepseek_v3", "adapter" if V5 else "trainable")],
)
def test_adapter_round_trip_saves_only_what_training_changes(tmp_path, name, router):
    model = lora.apply_lora(tiny(name), lora_of({"rank": 4, "router": router}), False)
    perturb_adapters(model)
    expected = logits(model, inputs())
    lora.save_adapter(model, tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", lora.SETTINGS_FILE} <= set(files)
    assert (lora.ROUTER_FILE in files) == (router == "trainable")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in key for key in saved)  # no base weight in the adapter file
    assert sum(t.numel() for t in saved.values()) == lora.trainable_parameter_report(model)["adapter"]

    fresh = lora.load_adapter(tiny(name), tmp_path / "adapter")  # a new process: base model + adapter
    assert torch.equal(logits(fresh, inputs()), expected)
    assert lora.trainable_parameter_report(fresh)["trainable"] == lora.trainable_parameter_report(model)["trainable"]

    wrapped = lora.apply_lora(
        tiny(name), lora_of({"rank": 4, "router": router}), False
    )  # resume: adapters already in place
    assert lora.load_adapter(wrapped, tmp_path / "adapter") is wrapped
    assert torch.equal(logits(wrapped, inputs()), expected)
    with pytest.raises(lora.LoraConfigError, match="trained with train.lora"):
        lora.load_adapter(
            lora.apply_lora(tiny(name), lora_of({"rank": 8, "router": router}), False), tmp_path / "adapter"
        )


def test_resumed_lora_training_continues_bit_for_bit(tmp_path):
    """Adapters + AdamW state saved at step 2 and loaded into a fresh base model give the same steps 3-4."""
    from safetensors.torch import load_file, save_file

    def step(model, optimizer, seed):
        model.train()
        x = inputs(seed)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def optimizer_for(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    settings = {"rank": 4, "router": "trainable"}
    model = lora.apply_lora(tiny(), lora_of(settings), gradient_checkpointing=True)
    optimizer = optimizer_for(model)
    for seed in (10, 11):
        step(model, optimizer, seed)
    lora.save_adapter(model, tmp_path / "ckpt")
    state = optimizer.state_dict()
    save_file(
        {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items()},
        str(tmp_path / "ckpt" / "optimizer.safetensors"),
    )
    uninterrupted = [step(model, optimizer, seed) for seed in (12, 13)]

    resumed_model = lora.load_adapter(tiny(), tmp_path / "ckpt", gradient_checkpointing=True)
    resumed_optimizer = optimizer_for(resumed_model)
    flat = load_file(str(tmp_path / "ckpt" / "optimizer.safetensors"))
    resumed_state = {"state": {}, "param_groups": state["param_groups"]}
    for key, value in flat.items():
        index, name = key.split(".", 1)
        resumed_state["state"].setdefault(int(index), {})[name] = value
    resumed_optimizer.load_state_dict(resumed_state)
    assert [step(resumed_model, resumed_optimizer, seed) for seed in (12, 13)] == uninterrupted


@pytest.mark.parametrize(
    "name,router",
    [("qwen3_moe", "adapter" if V5 else "trainable"), ("mixtral", "adapter"), ("deepseek_v3", "trainable")],
)
def test_merged_model_matches_the_adapters_and_loads_with_from_pretrained(tmp_path, name, router):
    from transformers import AutoModelForCausalLM

    model = lora.apply_lora(tiny(name), lora_of({"rank": 4, "router": router}), gradient_checkpointing=True)
    perturb_adapters(model)
    unmerged = logits(model, inputs())
    save_final_model(model, None, tmp_path / "merged", max_shard_size="5GB")
    assert lora.is_lora_model(model) and torch.equal(logits(model, inputs()), unmerged)  # the model keeps its adapters
    assert not (
        tmp_path / "merged" / "adapter_config.json"
    ).exists()  # else from_pretrained would treat it as an adapter
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True, torch_dtype=torch.float32)
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    torch.testing.assert_close(logits(loaded, inputs()), unmerged, rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["use_cache"] is True
    assert torch.equal(
        logits(make_model(folder_settings(), folder=tmp_path / "merged"), inputs()), logits(loaded, inputs())
    )
    base = logits(tiny(name), inputs())
    assert (unmerged - base).abs().max() > 1e-3  # the adapters changed something, so the match above means something


@pytest.mark.parametrize("name,router", [("qwen3_moe", "frozen"), ("mixtral", "adapter")])
def test_adapter_output_loads_with_plain_peft_and_a_full_run_gets_a_marker(tmp_path, name, router):
    """train_model's adapter output: PeftModel.from_pretrained on the base model gives the trained logits."""
    from peft import PeftModel

    model = lora.apply_lora(tiny(name), lora_of({"rank": 4, "router": router}), False)
    perturb_adapters(model)
    expected = logits(model, inputs())
    report = lora.save_adapter_output(model, tmp_path / "adapter")
    assert report["method"] == "lora" and report == json.loads((tmp_path / "adapter" / lora.REPORT_FILE).read_text())
    assert 0 < report["trainable"] < report["total"]
    loaded = PeftModel.from_pretrained(tiny(name), str(tmp_path / "adapter"))
    assert torch.equal(logits(loaded, inputs()), expected)

    full = tiny(name)
    marker = lora.save_adapter_output(full, tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [lora.REPORT_FILE]
    assert marker["method"] == "full" and marker["trainable"] == marker["total"] == sum(
        p.numel() for p in full.parameters()
    )


def test_train_settings_drop_lora_settings_of_a_full_run():
    full = load()
    changed = load(overrides={"train": {"lora": {"rank": 4}}})
    assert train_settings(full)["lora"] is None
    assert warmup_key(full) == warmup_key(changed)
    assert plan_settings(full) == plan_settings(changed)
    lora_run = load(overrides={"train": {"method": "lora"}})
    lora_changed = load(overrides={"train": {"method": "lora", "lora": {"rank": 4}}})
    assert train_settings(lora_run)["lora"]["rank"] == 16
    assert warmup_key(lora_run) != warmup_key(lora_changed) != warmup_key(full)


@pytest.mark.parametrize("router", ["frozen", "trainable", "adapter"])
def test_router_learning_rate_and_freeze_see_peft_names(router):
    """moeflow.train.param_groups.param_groups finds the router under peft (its weight, base_layer or own adapter), and
    the Trainer steps it at its learning rate."""
    from tiny_training import packed_rows

    from moeflow.data.collate import collate
    from moeflow.train.param_groups import param_groups
    from moeflow.train.trainer import Trainer

    def train(**section):
        return typed(TrainSettings, training({"steps": 1, "lr": 1e-3, **section}))

    settings = train(router_lr_multiplier=0.5)
    model = lora.apply_lora(tiny("mixtral"), lora_of({"rank": 4, "router": router}), False)
    routers = [f"base_model.model.{name}." for name in lora.router_modules(model)]
    trainable_router = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith(tuple(routers))}
    groups = param_groups(model, settings)
    by_id = {id(p): n for n, p in model.named_parameters()}
    in_router_groups = {by_id[id(p)] for g in groups if g["name"].startswith("router") for p in g["params"]}
    assert in_router_groups == trainable_router and bool(trainable_router) is (router != "frozen")
    assert all(g["lr_multiplier"] == 0.5 for g in groups if g["name"].startswith("router"))
    trainer = Trainer(model, settings, packed_rows(), collate_fn=collate, seed=0)
    trainer.train_step()  # the Trainer sets train.lr x the group's multiplier x the schedule (1 at step 1 here)
    rates = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert all(rate == (5e-4 if name.startswith("router") else 1e-3) for name, rate in rates.items()), rates
    param_groups(model, train(freeze_router=True))
    assert not lora.router_is_trainable(model)


# --------------------------------------------------------------------------- routers


@pytest.mark.parametrize("router,trainable", [("frozen", False), ("trainable", True), ("adapter", True)])
def test_router_is_trainable_follows_the_router_mode(router, trainable):
    model = lora.apply_lora(tiny("mixtral"), lora_of({"rank": 4, "targets": ["attention"], "router": router}), False)
    assert lora.router_is_trainable(model) is trainable
    report = lora.trainable_parameter_report(model)
    assert (report["by_category"]["router"]["trainable"] > 0) is trainable
    full = tiny("mixtral")
    assert lora.router_is_trainable(full)
    for router_module in lora.router_modules(full).values():
        router_module.requires_grad_(False)  # what train.freeze_router does
    assert not lora.router_is_trainable(full)


@pytest.mark.parametrize(
    "router",
    [
        "frozen",
        "trainable",
        "adapter",
    ],
)
def test_routing_capture_sees_the_adapted_router_and_the_balance_gradient_path(router):
    """Routing telemetry works on the LoRA model. With a frozen router a balancing loss trains no router
    weight, yet its gradient reaches adapters upstream of the routers (attention, earlier layers)."""
    model = lora.apply_lora(tiny("qwen3_moe"), lora_of({"rank": 4, "targets": ["attention"], "router": router}), False)
    perturb_adapters(model)
    model.train()
    adapter = routing.adapter_for(model)
    with routing.capture(model, adapter) as captured:
        model(input_ids=inputs(), use_cache=False)
    assert [layer.layer for layer in captured.layers] == [0, 1]
    balance = sum((layer.probs().mean(0) ** 2).sum() * layer.num_experts for layer in captured.layers)
    balance.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    attention = [g for n, g in grads.items() if "self_attn" in n]
    assert attention and all(g is not None and g.abs().sum() > 0 for g in attention)
    router_grads = [g for n, g in grads.items() if ".mlp.gate" in n]
    assert bool(router_grads) is (router != "frozen") and all(g.abs().sum() > 0 for g in router_grads)


# --------------------------------------------------------------------------- the embedded default


def test_embedded_default_lora_trains_a_few_percent_of_the_parameters():
    cfg = load()
    model_cfg = cfg["model"] | {"experts_implementation": "eager"}  # outside a stage: no measured choice
    full = make_model(typed(ModelSettings, model_cfg), vocab_size=cfg["tokenizer"]["vocab_size"])
    full_report = lora.trainable_parameter_report(full)
    lora_model = lora.apply_lora(
        make_model(typed(ModelSettings, model_cfg), vocab_size=cfg["tokenizer"]["vocab_size"]),
        lora_of(cfg["train"]["lora"]),
        False,
    )
    report = lora.trainable_parameter_report(lora_model)
    assert full_report["trainable"] == full_report["total"]
    assert report["total"] == full_report["total"] + report["adapter"]
    assert 0 < report["trainable"] < 0.3 * full_report["trainable"]

    shape, counted, _ = count_parameters(cfg["model"], cfg["tokenizer"]["vocab_size"])
    assert counted.total == full_report["total"]
    assert lora_count(shape, lora_of(cfg["train"]["lora"])).trainable == report["trainable"]
    print(
        f"\nembedded default: full {full_report['trainable']:,} trainable; LoRA {report['trainable']:,} "
        f"({100 * report['trainable_fraction']:.2f}%) {report['by_category']}"
    )


# GPT-OSS (its norms kept in fp32 by transformers) where peft can adapt its fused experts: transformers 5
@pytest.mark.parametrize("name,router", [("qwen3_moe", "trainable"), ("gpt_oss" if V5 else "mixtral", "frozen")])
def test_lora_under_bf16_holds_the_frozen_base_in_bf16_and_the_adapters_in_fp32(tmp_path, name, router):
    """#38: with precision bf16 the frozen base is loaded and held in bf16 (no fp32 copy of a 30B model), the
    adapters and a trainable router in fp32. bf16-autocast steps move only those (every base tensor bit-identical),
    the loss falls, and the planner counts the weights as they are held."""
    from tiny_training import packed_rows, settings

    from moeflow.data.collate import collate
    from moeflow.loading.factory import Layout
    from moeflow.model.wrappers import unwrap
    from moeflow.plan.memory import Job, PlanMemoryStage, held_weight_bytes
    from moeflow.train.trainer import Trainer

    tiny(name).save_pretrained(tmp_path / "base")
    train = settings(method="lora", lora={"rank": 4, "router": router}, steps=6, lr=2e-2, min_lr=2e-2)
    one = Layout.single("cpu", train)
    layout = Layout(one.ranks, one.parallel, train, "bf16")
    model = make_model(folder_settings(attn_implementation="eager"), folder=tmp_path / "base", layout=layout)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    routers = {n for n in trained if "lora_" not in n}
    assert trained and bool(routers) == (router == "trainable")
    assert {n: p.dtype for n, p in model.named_parameters() if n in trained} == dict.fromkeys(trained, torch.float32)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in trained}
    fp32_modules = tuple(getattr(unwrap(model, peft=True), "_keep_in_fp32_modules", None) or ())
    kept = {n for n, p in frozen.items() if p.dtype != torch.bfloat16 and not any(m in n for m in fp32_modules)}
    assert not kept, f"frozen weights not in bf16: {sorted(kept)[:5]}"
    # one batch of four rows, every step: the loss on it falls
    trainer = Trainer(model, train, packed_rows(n=4), collate_fn=collate, seed=0, precision="bf16")
    trainer.run()
    loss = [r["ce"] for r in trainer.train_records()]
    assert loss[-1] < loss[0], loss
    for n, p in model.named_parameters():
        if n not in trained:
            assert torch.equal(p, frozen[n]), n

    lora_section = {"method": "lora", "lora": {"rank": 4, "router": router}}
    planned = plan_settings(load(overrides={"train": lora_section, "precision": "bf16"}))
    planned["model"] = planned["model"] | {"config": section(name)["config"]}  # the tiny model's, no default's keys
    planned = typed(PlanMemoryStage, planned)
    shape, params, _ = count_parameters(planned.model, VOCAB)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    # exact but for the few norms transformers keeps in fp32 (GPT-OSS's), which the planner counts in bf16
    assert held_weight_bytes(shape, params, Job.from_settings(planned)) == pytest.approx(held, rel=0.01)
