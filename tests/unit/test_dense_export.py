"""The dense twin's export: a qwen3_moe model with no experts is written as Qwen3 (moeflow.checkpoint.dense_export),
which ``from_pretrained`` loads as Qwen3ForCausalLM with the same logits, and the planner reads as the MoE family's
shape with no MoE layer. A model with experts keeps its config."""

from __future__ import annotations

import dataclasses
import json

import torch
from tiny_models import tiny_dense_cfg, tiny_model_cfg

from moeflow.checkpoint.dense_export import moe_layers
from moeflow.checkpoint.export import save_final_model
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.plan.shapes import model_shape
from moeflow.settings import typed

VOCAB = 96


def built(cfg):
    return make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=3)


def test_a_model_without_experts_is_exported_as_qwen3_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_dense_cfg("eager", max_position_embeddings=64)
    assert cfg["config"]["model_type"] == "qwen3_moe" and cfg["config"]["num_experts"] == 0
    model = built(cfg)
    save_final_model(model, None, tmp_path / "model", "5GB")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["architectures"] == ["Qwen3ForCausalLM"]
    assert not {"num_experts", "moe_intermediate_size", "num_experts_per_tok"} & set(written)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, attn_implementation="eager")
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(1, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = loaded.eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    # the planner reads the dense folder as the MoE family with no MoE layer (top-k and expert width unused)
    dense_shape = model_shape(written, VOCAB)
    moe_shape = model_shape(cfg["config"], VOCAB)
    unused = {"top_k": dense_shape.top_k, "expert_ffn": dense_shape.expert_ffn}
    assert dense_shape == dataclasses.replace(moe_shape, **unused) and dense_shape.moe_layers == ()


def test_a_model_with_experts_keeps_its_architecture(tmp_path):
    model = built(tiny_model_cfg("eager", max_position_embeddings=64))
    assert model.config.num_experts == 4 and moe_layers(model) == 2
    save_final_model(model, None, tmp_path / "model", "5GB")
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "qwen3_moe"
