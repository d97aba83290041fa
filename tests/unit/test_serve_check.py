"""The serving check (moeflow.serving.check): the comparison and the tensor check on their own, then tiny folders of
every family vLLM's CPU build runs, scored in vLLM (the serving environment, `make serve-env`) against moeflow's own
forward, and planted defects that must fail: an export whose tensors are not its base's (a dropped MTP tensor, a
renamed router, a transposed expert tensor), and an engine that computes another model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import SERVE_PYTHON, needs_serve_env, only_on
from safetensors.torch import load_file, save_file
from tiny_models import model_config

from moeflow.data.tokenizer import train_tokenizer
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.serving import check
from moeflow.serving.process import EngineError
from moeflow.serving.settings import unsupported_reason
from moeflow.settings import typed

# vLLM's CPU attention takes head sizes of 32 and more: the tiny families at hidden size 64, two heads of 32.
SERVED = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "granitemoe")
# vLLM generates one token after each: the longest is one under the tiny configs' max_position_embeddings (64).
SEQUENCES = [list(range(5, 60)), list(range(100, 163)), [7, 9] * 20]


def served_config(family: str, **fields) -> dict:
    cfg = model_config(family)
    cfg["config"] |= {"hidden_size": 64, **({"head_dim": 32} if "head_dim" in cfg["config"] else {})}
    if family == "qwen2_moe":  # as published (Qwen1.5-MoE, Qwen2-57B-A14B): no sliding window
        cfg["config"]["use_sliding_window"] = False
    cfg["config"] |= fields
    return cfg


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"def f{i}(x): return x * {i} + {i % 7}  # alpha beta gamma" for i in range(300)]
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


def save_folder(folder: Path, cfg: dict, tokenizer) -> Path:
    make_model(typed(ModelSettings, cfg), vocab_size=len(tokenizer), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def moeflow_logprobs(folder: Path) -> list[dict]:
    settings = typed(ModelSettings, {"config": {}, "attn_implementation": "eager", "experts_implementation": "eager"})
    return check.model_logprobs(make_model(settings, folder=folder).eval(), SEQUENCES)


def rewrite(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# --------------------------------------------------------------------------- the comparison


def test_the_comparison_passes_within_the_tolerance_and_fails_beyond():
    ref = [{"token": [-1.0, -2.0, -3.0], "top": [4, 5, 6], "margin": [0.5, 0.5, 0.5]}]
    close = [{"token": [-1.0, -2.00001, -3.0], "top": [4, 5, 6]}]
    agreement = check.compare(ref, close, 1e-4)
    assert agreement["passed"] and agreement["top_token_agreement"] == 1.0 and agreement["positions"] == 3
    assert agreement["max_abs_logprob_diff"] == pytest.approx(1e-5, rel=1e-3)
    far = [{"token": [-1.0, -2.0, -3.01], "top": [4, 5, 6]}]
    failed = check.compare(ref, far, 1e-4)
    assert not failed["passed"] and failed["worst"] == {"sequence": 0, "position": 3}


def test_a_nan_or_a_length_the_engine_changed_fails_naming_where():
    ref = [{"token": [-1.0, -2.0, -3.0], "top": [4, 5, 6], "margin": [0.5, 0.5, 0.5]}]
    nan = check.compare(ref, [{"token": [-1.0, float("nan"), -3.0], "top": [4, 5, 6]}], 1e-4)
    assert not nan["passed"] and nan["worst"] == {"sequence": 0, "position": 2}
    with pytest.raises(check.ServeCheckError, match="sequence 0: the engine scored 2 positions, moeflow 3"):
        check.compare(ref, [{"token": [-1.0, -2.0], "top": [4, 5]}], 1e-4)


def test_a_top_token_that_differs_fails_unless_moeflows_top_two_tie():
    ref = [{"token": [-1.0, -2.0], "top": [4, 5], "margin": [0.5, 0.0]}]
    assert check.compare(ref, [{"token": [-1.0, -2.0], "top": [4, 9]}], 1e-4)["passed"]  # a tie: either is top
    flipped = check.compare(ref, [{"token": [-1.0, -2.0], "top": [8, 5]}], 1e-4)
    assert not flipped["passed"] and flipped["top_token_agreement"] == 0.0 and flipped["top_token_positions"] == 1


# --------------------------------------------------------------------------- the export's tensors against its base


def test_an_export_whose_tensors_are_not_its_bases_is_refused_naming_them(tmp_path, tokenizer):
    # deepseek_v3's tiny folder carries its published MTP layer (model.layers.3); its expert tensors are (16, 64) and
    # (64, 16): a transpose keeps the element count.
    base = save_folder(tmp_path / "base", served_config("deepseek_v3"), tokenizer)
    export = tmp_path / "export"
    shutil.copytree(base, export)
    assert check.tensor_differences(export, base) == {"missing": [], "unexpected": [], "reshaped": []}
    check.refuse_tensor_differences(check.tensor_differences(export, base), export)

    mtp = sorted(n for n in load_file(base / "model.safetensors") if n.startswith("model.layers.3."))
    assert mtp, "the tiny deepseek_v3 folder has an MTP layer"
    rewrite(export, lambda t: t.pop(mtp[0]))
    assert check.tensor_differences(export, base)["missing"] == [mtp[0]]

    shutil.rmtree(export)
    shutil.copytree(base, export)
    rewrite(export, lambda t: t.update({"model.layers.1.mlp.router.weight": t.pop("model.layers.1.mlp.gate.weight")}))
    found = check.tensor_differences(export, base)
    assert found["missing"] == ["model.layers.1.mlp.gate.weight"]
    assert found["unexpected"] == ["model.layers.1.mlp.router.weight"]
    with pytest.raises(check.ServeCheckError, match="missing 1: model.layers.1.mlp.gate.weight"):
        check.refuse_tensor_differences(found, export)

    shutil.rmtree(export)
    shutil.copytree(base, export)
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    rewrite(export, lambda t: t.update({name: t[name].t().contiguous()}))
    assert check.tensor_differences(export, base)["reshaped"] == [f"{name}: [64, 16] -> [16, 64]"]


def test_the_families_the_cpu_build_cannot_run_are_named_with_the_reason():
    for family in ("deepseek_v3", "gpt_oss", "step3p5"):
        assert unsupported_reason(family, "cpu") and unsupported_reason(family, "cuda") is None
    assert all(unsupported_reason(family, "cpu") is None for family in SERVED)


# --------------------------------------------------------------------------- in vLLM


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent; the smoke pipeline checks both stacks' exports")
@pytest.mark.parametrize("family", SERVED)
def test_every_family_the_cpu_build_runs_serves_as_moeflow_computes_it(tmp_path, tokenizer, family):
    folder = save_folder(tmp_path / family, served_config(family), tokenizer)
    engine = check.engine_logprobs(SERVE_PYTHON, folder, SEQUENCES, "float32", 600)
    agreement = check.compare(moeflow_logprobs(folder), engine["sequences"], 1e-4)
    assert engine["engine"] == "vllm" and engine["device"] == "cpu"
    assert agreement["passed"], agreement
    assert agreement["max_abs_logprob_diff"] < 1e-5 and agreement["top_token_agreement"] == 1.0
    assert agreement["positions"] == sum(len(s) - 1 for s in SEQUENCES)


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent")
def test_an_engine_that_computes_another_model_fails_the_check(tmp_path, tokenizer):
    # Qwen2-MoE with its sliding window on (max_window_layers 1): vLLM 0.32 attends otherwise than transformers past
    # the window, so the two disagree by up to about 0.15 in log-prob. The published models leave it off.
    cfg = served_config("qwen2_moe", use_sliding_window=True)
    folder = save_folder(tmp_path / "qwen2_moe", cfg, tokenizer)
    engine = check.engine_logprobs(SERVE_PYTHON, folder, SEQUENCES, "float32", 600)
    agreement = check.compare(moeflow_logprobs(folder), engine["sequences"], 1e-4)
    assert not agreement["passed"] and agreement["max_abs_logprob_diff"] > 1e-2


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent")
def test_an_export_the_engine_cannot_read_fails_naming_the_tensor(tmp_path, tokenizer):
    folder = save_folder(tmp_path / "qwen3_moe", served_config("qwen3_moe"), tokenizer)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    rewrite(folder, lambda t: t.update({name: t[name].t().contiguous()}))
    with pytest.raises(EngineError, match="vLLM could not serve") as refused:
        check.engine_logprobs(SERVE_PYTHON, folder, SEQUENCES, "float32", 600)
    assert "size" in str(refused.value) or "shape" in str(refused.value), str(refused.value)[-2000:]


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent")
def test_a_weight_the_engine_reads_otherwise_fails_the_check(tmp_path, tokenizer):
    # moeflow scores the folder as saved; vLLM a copy whose final norm is scaled by 1.01
    folder = save_folder(tmp_path / "olmoe", served_config("olmoe"), tokenizer)
    served = tmp_path / "served"
    shutil.copytree(folder, served)
    rewrite(served, lambda t: t.update({"model.norm.weight": t["model.norm.weight"] * 1.01}))
    engine = check.engine_logprobs(SERVE_PYTHON, served, SEQUENCES, "float32", 600)
    agreement = check.compare(moeflow_logprobs(folder), engine["sequences"], 1e-4)
    assert not agreement["passed"] and agreement["max_abs_logprob_diff"] > 1e-4


def test_a_missing_serving_python_is_refused_saying_what_to_do(tmp_path):
    with pytest.raises(EngineError, match="make serve-env"):
        check.engine_logprobs(tmp_path / "nothing" / "python", tmp_path, SEQUENCES, "float32", 60)


def test_moeflows_logprobs_are_the_models_log_softmax(tmp_path, tokenizer):
    folder = save_folder(tmp_path / "olmoe", served_config("olmoe"), tokenizer)
    ref = moeflow_logprobs(folder)
    settings = typed(ModelSettings, {"config": {}, "attn_implementation": "eager", "experts_implementation": "eager"})
    model = make_model(settings, folder=folder).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCES[0]])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(SEQUENCES[0]) - 1), SEQUENCES[0][1:]]
    assert ref[0]["token"] == pytest.approx(expected.tolist(), abs=1e-6)
    assert ref[0]["top"] == logits.argmax(-1).tolist() and min(ref[0]["margin"]) >= 0


# --------------------------------------------------------------------------- a LoRA run's serving adapter


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory):
    from adapter_fixtures import write_base

    return write_base(tmp_path_factory.mktemp("base") / "qwen3_moe", "qwen3_moe")


def serving_adapter(tmp_path: Path, saved_on: str) -> Path:
    from adapter_fixtures import FIXTURES

    from moeflow.serving.adapter import write_serving_adapter

    out = tmp_path / "serving"
    written = write_serving_adapter(FIXTURES / saved_on / "qwen3_moe", out)
    # 2 MoE layers x 8 experts x (gate, up, down), and q, k, v, o in each layer
    assert written["expert_modules"] == 48 and written["modules"] == 56 and written["rank"] == 2
    assert written["split_from_fused"] == (saved_on == "current")
    return out


@pytest.mark.parametrize("saved_on", ("pinned", "current"))
def test_the_serving_adapter_is_one_adapter_per_expert_module_and_computes_what_was_trained(
    tmp_path, qwen3_base, saved_on
):
    from adapter_fixtures import FIXTURES, load_base, logits

    from moeflow.model import lora

    out = serving_adapter(tmp_path, saved_on)
    names = load_file(out / "adapter_model.safetensors").keys()
    assert not any(".experts.base_layer." in n or n.endswith("experts.lora_A.weight") for n in names)
    assert "base_model.model.model.layers.1.mlp.experts.7.up_proj.lora_B.weight" in names
    model = lora.load_adapter(load_base(qwen3_base), out)
    expected = load_file(FIXTURES / saved_on / "qwen3_moe" / "logits.safetensors")["logits"]
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)


@only_on("pinned", "transformers 4.57 holds one module per expert, the layout the serving adapter is written in")
def test_peft_alone_attaches_every_expert_of_a_serving_adapter_from_the_fused_stack(tmp_path, qwen3_base):
    from adapter_fixtures import FIXTURES, load_base, logits
    from peft import PeftModel

    bare = PeftModel.from_pretrained(load_base(qwen3_base), str(serving_adapter(tmp_path, "current")))
    expected = load_file(FIXTURES / "current" / "qwen3_moe" / "logits.safetensors")["logits"]
    torch.testing.assert_close(logits(bare), expected, rtol=0, atol=1e-5)


def model_folder_for(tmp_path: Path) -> Path:
    """A folder with the fixtures' base config as a published export names its architecture."""
    import json

    from adapter_fixtures import config_of

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_of("qwen3_moe") | {"architectures": ["Qwen3MoeForCausalLM"]}))
    return folder


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent, and both stacks' kept adapters are read here")
@pytest.mark.parametrize("saved_on", ("pinned", "current"))
def test_vllms_adapter_loader_reads_every_expert_of_the_serving_adapter(tmp_path, saved_on):
    from moeflow.serving.adapter import engine_read_adapter, engine_read_differences

    out = serving_adapter(tmp_path, saved_on)
    engine, read = engine_read_adapter(SERVE_PYTHON, model_folder_for(tmp_path), out, 300)
    assert engine_read_differences(out, engine, read) == []
    assert len(engine["names"]) == 56 and engine["scaling"] == 2.0  # alpha 4 / r 2
    # vLLM's stacking of each MoE layer: w1, w2, w3 factors A (experts, r, in) and B (experts, out, r)
    assert engine["stacked"]["model.layers.1.mlp.experts"] == [
        [8, 2, 32],
        [8, 2, 16],
        [8, 2, 32],
        [8, 16, 2],
        [8, 32, 2],
        [8, 16, 2],
    ]


@needs_serve_env
@only_on("pinned", "vLLM's side is stack-independent")
def test_a_serving_adapter_that_lost_an_expert_is_refused_by_vllms_loader(tmp_path):
    from moeflow.serving.adapter import engine_read_adapter

    out = serving_adapter(tmp_path, "current")
    rewrite_adapter = {
        k: v for k, v in load_file(out / "adapter_model.safetensors").items() if ".experts.5.down_proj." not in k
    }
    save_file(rewrite_adapter, out / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EngineError, match="could not serve"):
        engine_read_adapter(SERVE_PYTHON, model_folder_for(tmp_path), out, 300)
