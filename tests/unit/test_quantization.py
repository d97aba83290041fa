"""A quantized frozen base (QLoRA, ``model.quantization``): bitsandbytes' formats, every decoder matrix quantized
(the fused experts included), training that moves only the adapters, resume, and the merged export.

The model is a tiny qwen3_moe saved with ``save_pretrained`` (the published layout: one tensor per expert
projection, which transformers 5 fuses at load) and loaded as a user's folder, in bf16 as on a GPU. Its widths are
multiples of 32, as bitsandbytes' 4-bit blocks need (a model's are multiples of 64). The 2-rank FSDP run is
tests/pipeline/test_train_distributed.py's; the config check's refusals are at the end.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_models import folder_settings, tiny_model_cfg
from tiny_training import VOCAB, packed_rows, settings

from moeflow.checkpoint.export import save_final_model
from moeflow.data.collate import collate
from moeflow.loading.factory import Layout, make_model
from moeflow.model import parameters as P
from moeflow.model.lora import load_adapter, save_adapter_output
from moeflow.model.quantization import Packing, QuantizationError, pack, quantized_weights, unpack
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import ConfigError, typed
from moeflow.train.trainer import Trainer
from moeflow.workflow.load import load

BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None  # the current stack's (it needs torch 2.4)
needs_bitsandbytes = pytest.mark.skipif(not BITSANDBYTES, reason="bitsandbytes runs on torch 2.4+: the current stack")

WIDE = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ERRORS = {"nf4": 0.1, "fp4": 0.13, "int8": 0.01}  # relative error of a random matrix's round trip (measured 0.09, 0.12)
QLORA = {"method": "lora", "gradient_checkpointing": True, "lora": {"rank": 4, "targets": ["all"], "router": "adapter"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora") / "base"
    make_model(typed(ModelSettings, tiny_model_cfg(**WIDE)), vocab_size=VOCAB, seed=5).save_pretrained(out)
    return out


def qlora(folder, kind="nf4", precision="bf16", **train):
    """The QLoRA model of ``folder`` in one process, and its training settings."""
    train = settings(**QLORA, **train)
    single = Layout.single("cpu", train)
    layout = Layout(single.ranks, single.parallel, train, precision)
    return make_model(folder_settings(quantization=kind), folder=folder, layout=layout), train


@needs_bitsandbytes
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_a_weight_packs_by_rows_so_any_run_of_rows_unpacks_alone(kind):
    """The stored tensor keeps the weight's leading dimensions, each row its codes and scales: a shard of rows (FSDP's,
    a fused expert stack's experts) dequantizes on its own."""
    dense = torch.randn(6, 8, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packing = Packing(kind, tuple(dense.shape), 128 if kind == "int8" else 64)
    stored = pack(kind, dense, packing.block)
    assert stored.dtype == torch.uint8 and tuple(stored.shape) == packing.stored_shape
    whole = unpack(packing, stored, torch.bfloat16)
    error = float((whole.float() - dense.float()).norm() / dense.float().norm())
    assert 0 < error < ERRORS[kind], error
    assert torch.equal(unpack(packing, stored[2:5], torch.bfloat16), whole[2:5])
    ratio = stored.numel() / (dense.numel() * 2)
    assert ratio == pytest.approx({"nf4": 0.28125, "fp4": 0.28125, "int8": 0.515625}[kind])  # of bf16's bytes


@needs_bitsandbytes
def test_every_decoder_matrix_is_quantized_the_experts_too_and_nothing_else(folder):
    model, _ = qlora(folder)
    quantized = quantized_weights(model)
    layers = range(tiny_model_cfg()["config"]["num_hidden_layers"])
    want = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers for p in "qkvo"}
    want |= {f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in ("gate_up_proj", "down_proj")}
    assert set(quantized) == want
    params = {P.base_name(n): p for n, p in model.named_parameters() if not P.is_adapter(n)}
    kept = {n: p for n, p in params.items() if n not in quantized}
    matrices = {n for n, p in kept.items() if p.dim() > 1}
    assert all(P.category(n) in (P.EMBEDDING, P.ROUTER, P.LM_HEAD) for n in matrices), matrices  # norms: 1-D
    assert {p.dtype for p in kept.values()} == {torch.bfloat16}  # the compute dtype
    assert {params[n].dtype for n in quantized} == {torch.uint8}
    with pytest.raises(QuantizationError, match="rows are 16 wide.*multiples of 32"):
        narrow = tiny_model_cfg(**{**WIDE, "moe_intermediate_size": 16})
        narrow_folder = folder.parent / "narrow"
        make_model(typed(ModelSettings, narrow), vocab_size=VOCAB, seed=5).save_pretrained(narrow_folder)
        qlora(narrow_folder)


@needs_bitsandbytes
def test_the_mtp_layers_are_carried_unquantized():
    """DeepSeek-V3's MTP layer sits in ``model.layers`` beside the decoder layers; it is carried frozen into the
    export as it is, so none of its weights is quantized (they were, unnoticed, until a review)."""
    from tiny_models import model_config

    from moeflow.families.mtp import is_mtp_name, mtp_prefixes

    section = model_config("deepseek_v3")
    widths = {"hidden_size": 64, "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 32}
    section["config"] |= widths | {"qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}
    train = settings(**{**QLORA, "lora": {"rank": 4, "targets": ["all"], "router": "frozen"}})
    model = make_model(
        typed(ModelSettings, {**section, "quantization": "nf4"}), vocab_size=VOCAB, layout=Layout.single("cpu", train)
    )
    quantized, mtp = quantized_weights(model), mtp_prefixes(model.get_base_model())
    assert mtp and not [n for n in quantized if is_mtp_name(n, mtp)]
    assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= set(quantized)
    assert any(is_mtp_name(n, mtp) and p.dtype == torch.float32 and p.dim() == 2 for n, p in model.named_parameters())


@needs_bitsandbytes
def test_a_quantized_base_computes_what_its_rounded_weights_do(folder):
    """Its logits are those of the bf16 model with every quantized weight rounded through NF4 (exactly the same
    arithmetic), and within NF4's error of the bf16 model's."""
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    model = qlora(folder, precision="fp32")[0].eval()
    plain = make_model(folder_settings(), folder=folder).eval()
    rounded = make_model(folder_settings(), folder=folder).eval()
    with torch.no_grad():
        for name, weight in quantized_weights(model).items():
            packing = weight.dequantize.packing
            target = rounded.get_parameter(name)
            target.copy_(unpack(packing, pack(packing.kind, target.detach(), packing.block), target.dtype))
        got, want, exact = (m(input_ids=x).logits for m in (model, rounded, plain))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert 0 < float((got - exact).norm() / exact.norm()) < 0.2  # 0.1 per weight, through two layers


@needs_bitsandbytes
def test_training_moves_only_the_adapters_resumes_exactly_exports_and_saves_the_trained_model(folder, tmp_path):
    from transformers import AutoModelForCausalLM

    model, train = qlora(folder, precision="fp32", steps=4, checkpoint_every=2)
    stored = {n: w.stored.detach().clone() for n, w in quantized_weights(model).items()}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = Trainer(model, train, packed_rows(n=4), collate_fn=collate, seed=0, checkpoint_dir=tmp_path / "ck")
    trainer.run()
    losses = [r["loss"] for r in trainer.train_records()]
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(w.stored, stored[n]) for n, w in quantized_weights(model).items())
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)

    again, train = qlora(folder, precision="fp32", steps=4, checkpoint_every=2)
    resumed = Trainer(again, train, packed_rows(n=4), collate_fn=collate, seed=0, checkpoint_dir=tmp_path / "ck")
    assert resumed.resume() and resumed.step == 2  # step 2's checkpoint, read into a fresh quantized model
    resumed.run()
    assert [r["loss"] for r in resumed.train_records()] == losses  # bit for bit
    weights = dict(again.named_parameters())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())

    save_final_model(model, None, tmp_path / "merged", "5GB", source=folder)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True, dtype=torch.float32)
    assert not any("lora" in n or "parametrizations" in n for n, _ in merged.named_parameters())
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, model.eval()(input_ids=x).logits, rtol=0, atol=1e-5)
    assert all(torch.equal(w.stored, stored[n]) for n, w in quantized_weights(model).items())  # export reads only

    # the adapter file (the experts' factors in peft's layout) loads on a fresh quantized base as trained
    save_adapter_output(model, tmp_path / "adapter")
    loaded = load_adapter(qlora(folder, precision="fp32")[0], tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)


def test_the_config_check_refuses_what_a_quantized_base_cannot_run():
    """A full fine-tune over it, LoRA without activation checkpointing, adapters on the routed experts alone (they go
    beside peft's, moeflow.model.quantized_experts) and (the pinned stack's torch 2.3) a torch bitsandbytes does not
    run on, naming the stack to use."""
    with pytest.raises(ConfigError, match="'model.quantization': nf4 and 'train.method': full"):
        load(overrides={"model": {"quantization": "nf4"}, "runs": {"lora": None, "esft": None}})
    with pytest.raises(ConfigError, match="needs train.gradient_checkpointing: true"):
        load(overrides={"model": {"quantization": "nf4"}, "train": {"method": "lora"}, "runs": {"esft": None}})
    accepted = {"model": {"quantization": "int8"}, "train": {"method": "lora", "gradient_checkpointing": True}}
    experts_alone = {**accepted, "train": accepted["train"] | {"lora": {"targets": ["routed_experts"]}}}
    with pytest.raises(ConfigError, match=r"'train.lora.targets': \[routed_experts\] do not combine.*Add attention"):
        load(overrides={**experts_alone, "runs": {"esft": None}})
    if compat.version_of("torch").release >= (2, 4):
        load(overrides={**accepted, "runs": {"esft": None}})
    else:
        with pytest.raises(ConfigError, match="needs torch 2.4 or newer.*STACK=current"):
            load(overrides={**accepted, "runs": {"esft": None}})
