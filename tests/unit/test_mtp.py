"""MTP layers carried through (moeflow.families.mtp): built and loaded with the model under the published
names, frozen, untouched by training, kept by checkpoints and resume, written back in the export, and named
in the run summary as not trained. DeepSeek-V3 on both stacks, Step-3.5-Flash on the current one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny_models import TRANSFORMERS_5_ONLY, VOCAB, build_family, model_config

from moeflow.checkpoint import export
from moeflow.checkpoint.state import load_checkpoint, save_checkpoint
from moeflow.data.collate import collate
from moeflow.families.mtp import mtp_layers, mtp_prefixes, mtp_report
from moeflow.loading.factory import make_model
from moeflow.model import parameters as P
from moeflow.model.lora import apply_lora
from moeflow.model.routing import adapter_for
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.param_groups import correction_biases
from moeflow.train.settings import LoraSettings, TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

# family: (its MTP layers' indices in the tiny model, their own module names in the published checkpoint)
FAMILIES = {
    "deepseek_v3": ([3], ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")),
    "step3p5": ([4, 5], ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.output")),
}
PARAMS = [pytest.param(f, marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="transformers 5 only"))
          if f in TRANSFORMERS_5_ONLY else f for f in FAMILIES]  # fmt: skip


def rows(n: int = 4, length: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "position_ids": list(range(length))})
    return out


def settings(steps: int = 2, **balance) -> TrainSettings:
    return typed(
        TrainSettings,
        training(
            {
                "steps": steps,
                "lr": 1e-2,
                "warmup_steps": 1,
                "micro_batch_size": 2,
                "balance": {"mode": "running", "coef": 0.01, **balance},
                "routing_guard": {"window_steps": 100},
                "memory_guard": {"skip_steps": 100},
            }
        ),
    )


def mtp_state(model) -> dict[str, torch.Tensor]:
    prefixes = mtp_prefixes(model)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith(prefixes)}


@pytest.mark.parametrize("family", PARAMS)
def test_mtp_layers_are_built_frozen_under_the_published_names_and_load_back(family, tmp_path):
    indices, own = FAMILIES[family]
    model = make_model(typed(ModelSettings, model_config(family)), vocab_size=VOCAB, seed=0)
    assert [name for name, _ in mtp_layers(model)] == [f"model.layers.{i}" for i in indices]
    prefixes = mtp_prefixes(model)
    frozen = {n: p.requires_grad for n, p in model.named_parameters() if n.startswith(prefixes)}
    assert frozen and not any(frozen.values())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith(prefixes))
    model.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    for i in indices:
        assert {f"model.layers.{i}.{m}.weight" for m in own} <= saved
        assert f"model.layers.{i}.input_layernorm.weight" in saved  # the decoder layer's own tensors
    assert {P.category(f"model.layers.{indices[0]}.{m}.weight") for m in own[:-1]} == {P.MTP}
    reloaded = make_model(typed(ModelSettings, model_config(family)), folder=tmp_path)
    again = mtp_state(reloaded)
    want = mtp_state(model)
    assert sorted(again) == sorted(want) and all(torch.equal(again[n], want[n]) for n in want)
    # a later MTP loss: one depth's hidden states and logits from the carried modules
    _, layer = mtp_layers(reloaded)[0]
    hidden = torch.randn(1, 6, reloaded.config.hidden_size)
    ids = torch.arange(6)[None]
    embeddings = reloaded.get_input_embeddings()(ids)
    if family == "step3p5":  # transformers 5's layers take the rotary angles of their own attention type
        kind = reloaded.config.mtp_layer_types[0]
        rotary = reloaded.model.rotary_emb(hidden, torch.arange(6)[None], kind)
    else:
        rotary = reloaded.model.rotary_emb(hidden, torch.arange(6)[None])
    depth = {
        "previous": hidden,
        "next_ids": ids,
        "next_embeddings": None if hasattr(layer, "embed_tokens") else embeddings,  # DeepSeek-V3's: its own
        "layer_kwargs": {"position_embeddings": rotary, "attention_mask": None},
        "loss": lambda normed, weight: normed @ weight.T,  # the depth's logits
    }
    logits, out = layer(mtp_depth=depth)
    assert out.shape == hidden.shape and logits.shape == (1, 6, VOCAB)


@pytest.mark.parametrize("family", PARAMS)
def test_training_leaves_the_mtp_layers_and_the_run_summary_says_so(family, tmp_path):
    model = build_family(family, dtype=torch.float32)
    assert not any(layer in adapter_for(model).moe_layers for layer in FAMILIES[family][0])  # never routed
    assert len(correction_biases(model)) == len(adapter_for(model).sites)  # the loss-free update skips them
    before, main = mtp_state(model), {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = Trainer(model.train(), settings(bias_update_rate=0.01), rows(), collate_fn=collate, seed=0)
    trainer.run()
    after = mtp_state(model)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert any(not torch.equal(p, main[n]) for n, p in model.named_parameters() if n in main)
    assert not any(id(p) in {id(q) for g in trainer.optimizer.param_groups for q in g["params"]} and p.grad is not None
                   for n, p in model.named_parameters() if n in before)  # fmt: skip
    report = mtp_report(model)
    assert report["layers"] == len(FAMILIES[family][0]) and report["trained"] is False
    assert report["parameters"] == sum(p.numel() for _, layer in mtp_layers(model) for p in layer.parameters())
    assert "not trained" in report["note"]
    assert (
        mtp_report(make_model(typed(ModelSettings, model_config("qwen3_moe")), vocab_size=VOCAB)) is None
    )  # a model without MTP layers


@pytest.mark.parametrize("family", PARAMS)
def test_mtp_layers_survive_a_checkpoint_resume_and_the_export(family, tmp_path):
    model = build_family(family, dtype=torch.float32, seed=0)
    trainer = Trainer(model.train(), settings(steps=1), rows(), collate_fn=collate, seed=0)
    trainer.run()
    save_checkpoint(tmp_path / "ckpt", model, trainer.optimizer, trainer.state(), trainer.history)
    fresh = build_family(family, dtype=torch.float32, seed=7)  # other MTP weights
    assert any(not torch.equal(mtp_state(fresh)[n], t) for n, t in mtp_state(model).items())
    resumed = Trainer(fresh.train(), settings(steps=1), rows(), collate_fn=collate, seed=0)
    load_checkpoint(tmp_path / "ckpt", fresh, resumed.optimizer)
    got, want = mtp_state(fresh), mtp_state(model)
    assert all(torch.equal(got[n], want[n]) for n in want)
    export.save_final_model(fresh, None, tmp_path / "export", max_shard_size="5GB")
    exported = make_model(typed(ModelSettings, model_config(family)), folder=tmp_path / "export")
    again = mtp_state(exported)
    assert sorted(again) == sorted(want) and all(torch.equal(again[n], want[n]) for n in want)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == family


@pytest.mark.parametrize("family", PARAMS)
def test_lora_gives_the_mtp_layers_no_adapters(family):
    if family == "deepseek_v3" and not compat.is_transformers_v5():
        lora = typed(LoraSettings, {"targets": ["attention", "shared_experts", "dense_ffn"]})  # 4.57: no fused experts
    else:
        lora = typed(LoraSettings, {})
    model = apply_lora(build_family(family, dtype=torch.float32), lora, gradient_checkpointing=False)
    adapted = [n for n, _ in model.named_parameters() if "lora_" in n]
    layers = {P.layer_index(n) for n in adapted}
    assert adapted and not layers & set(FAMILIES[family][0]), sorted(layers)
