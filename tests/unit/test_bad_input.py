"""Bad input is refused with a message that names the problem and what to do: config settings, models
(missing, dense where experts are needed, an unsupported family, a tokenizer the model cannot embed) and
held-out pools (empty, too small for the coverage constraints). Each test checks the whole message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_coverage_stage
from tiny_models import folder_settings

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.coverage.cover import CoverageInfeasible, infeasible_message
from moeflow.families.registry import FAMILIES
from moeflow.loading.factory import make_model
from moeflow.model.folder import ModelError, check_vocabulary, load_tokenizer
from moeflow.model.routing import ADAPTER_NEEDS, UnsupportedModel
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, ConfigError, typed
from moeflow.workflow.load import load

SMOKE = REPO_ROOT / "config" / "smoke.yaml"
SUPPORTED = ", ".join(sorted(FAMILIES))


def config_error(**overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load(SMOKE, overrides=overrides)
    return str(err.value)


# --------------------------------------------------------------------------- config


def test_negative_learning_rate():
    assert config_error(train={"lr": -1e-4}) == (
        "invalid configuration:\n  - config key 'train.lr': -0.0001 is less than or equal to the minimum of 0\n"
        "(schema: config/schema.yaml)"
    )


def test_warmup_longer_than_training():
    assert config_error(train={"warmup_steps": 20, "steps": 8}) == (
        "invalid configuration: config key 'train.warmup_steps' (20) must be less than 'train.steps' (8)"
    )


def test_warmup_steps_and_warmup_ratio_together_are_refused():
    assert config_error(train={"warmup_steps": 1000, "warmup_ratio": 0.1}) == (
        "invalid configuration: config keys 'train.warmup_steps' and 'train.warmup_ratio' are both set; give one of "
        "them (set the other to null), e.g. warmup_steps: 1000 or warmup_ratio: 0.1"
    )


def test_muon_is_refused_where_it_is_not_implemented_naming_train_optimizer():
    message = config_error(train={"optimizer": "muon", "method": "lora"})
    if hasattr(torch.optim, "Muon"):  # every layout takes it (ep included); LoRA does not
        assert "config key 'train.optimizer': muon is implemented for method: full only" in message
    else:  # the pinned stack (torch 2.3) refuses it in every layout, first
        assert "config key 'train.optimizer': muon needs torch.optim.Muon" in message and "STACK=current" in message


def test_a_global_batch_size_is_refused_with_how_the_global_batch_is_made():
    """moeflow has no global batch setting for a micro-batch to fail to divide: the global batch is the
    product micro_batch_size x grad_accum_steps x ranks. A copied global batch size says so."""
    assert config_error(train={"global_batch_size": 48}) == (
        "invalid configuration: config key 'train.global_batch_size': there is no global batch size to set (so no "
        "micro-batch that fails to divide it): the global batch is train.micro_batch_size x train.grad_accum_steps x "
        "the ranks (parallel.nproc_per_node x parallel.nnodes); set those"
    )


def test_wrong_type_and_unknown_key_in_a_run_overlay():
    assert config_error(runs={"moe": {"train": {"micro_batch_size": "2"}}}) == (
        "invalid configuration (run 'moe'):\n  - config key 'train.micro_batch_size': '2' is not of type 'integer'\n"
        "(schema: config/schema.yaml)"
    )
    assert config_error(evaluate={"batchsize": 4}) == (
        "invalid configuration:\n  - config key 'evaluate': unknown key(s) 'batchsize'; allowed keys are: batch_size, "
        "humaneval, lm_eval, max_sequences, ranks, strategy, tasks\n(schema: config/schema.yaml)"
    )


# --------------------------------------------------------------------------- models


def test_a_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(ModelError) as err:
        make_model(folder_settings(), folder=tmp_path / "no-such-model")
    assert str(err.value) == (
        f"model folder {tmp_path / 'no-such-model'} does not exist: point 'model.pretrained' at a local folder made "
        "by save_pretrained"
    )
    with pytest.raises(ModelError) as err:
        load_tokenizer(tmp_path / "no-such-model")
    assert str(err.value) == (
        f"tokenizer folder {tmp_path / 'no-such-model'} does not exist: it is the model folder ('model.pretrained') "
        "or one the pipeline trained"
    )


def test_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelError) as err:
        make_model(folder_settings(), folder=tmp_path / "weights")
    assert str(err.value) == (
        f"model folder {tmp_path / 'weights'} has no config.json: "
        "point 'model.pretrained' at a folder made by save_pretrained"
    )


def _model(model_type: str, **config):
    common = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 128,
    }
    return make_model(
        typed(
            ModelSettings,
            {
                "attn_implementation": "sdpa",
                "experts_implementation": STACK_DEFAULT_EXPERTS,
                "config": {"model_type": model_type, **common, **config},
            },
        ),
        vocab_size=300,
    )


def _coverage_refusal(model, root, tmp_path) -> str:
    """The coverage stage's error for ``model`` on the ``code`` pool."""
    with pytest.raises(UnsupportedModel) as err:
        build_valset(
            model,
            [root / "code"],
            {"pool_corpora": ["code"], "batch_tokens": 128},
            StageOutputs(tmp_path / "valset", tmp_path / "coverage.json", tmp_path / "heatmap.png"),
            "sdpa",
            seed=0,
        )
    return str(err.value)


def test_a_dense_model_where_the_coverage_stage_needs_experts(coverage_inputs, tmp_path):  # noqa: F811
    root, _ = coverage_inputs
    dense = _model("llama", intermediate_size=64)
    assert _coverage_refusal(dense, root, tmp_path) == (
        "the coverage stage routes the held-out pool through the model's experts, and this model has none it can read: "
        "no routing adapter for model_type 'llama' (its config names no experts, so it looks like a dense model). "
        f"Supported: {SUPPORTED}. To add one: {ADAPTER_NEEDS}. A dense run uses another run's validation set: set "
        "'coverage.valset_of_run' to an MoE run"
    )
    assert not any(tmp_path.iterdir())


def test_an_unsupported_moe_family(coverage_inputs, tmp_path):  # noqa: F811
    root, _ = coverage_inputs
    phimoe = _model("phimoe", intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    assert _coverage_refusal(phimoe, root, tmp_path) == (
        "the coverage stage routes the held-out pool through the model's experts, and this model has none it can read: "
        "no routing adapter for model_type 'phimoe' (its config has num_local_experts=4, so it looks like a "
        f"mixture-of-experts model). Supported: {SUPPORTED}. To add one: {ADAPTER_NEEDS}. A dense run uses another "
        "run's validation set: set 'coverage.valset_of_run' to an MoE run"
    )


def test_a_tokenizer_larger_than_the_model_vocabulary(coverage_inputs):  # noqa: F811
    root, model_cfg = coverage_inputs
    tokens = json.loads((root / "code" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    small = make_model(typed(ModelSettings, model_cfg), vocab_size=tokens - 40, seed=0)
    with pytest.raises(ModelError) as err:
        check_vocabulary(small, [root / "code"], "models/small")
    assert str(err.value) == (
        f"tokenizer/model mismatch: {root / 'code'} "
        f"was tokenized with a tokenizer of {tokens} tokens, but models/small "
        f"has {tokens - 40} embedding rows. "
        "Use the model's own tokenizer (model.pretrained brings it) or a model whose "
        "vocabulary covers the tokenizer"
    )
    check_vocabulary(
        make_model(typed(ModelSettings, model_cfg), folder=root / "base"), [root / "code"]
    )  # its own tokenizer: accepted
    check_vocabulary(
        make_model(typed(ModelSettings, model_cfg), vocab_size=tokens + 64, seed=0), [root / "code"]
    )  # padded rows: accepted


# --------------------------------------------------------------------------- held-out pools


def test_an_empty_held_out_pool(coverage_inputs, tmp_path):  # noqa: F811
    from moeflow.data.sharding import TokenizeStage, tokenize_corpus

    root, model_cfg = coverage_inputs
    settings = json.loads((root / "code" / "manifest.json").read_text())["settings"]
    no_heldout = {"heldout": 0.0, "test": 0.1}
    settings = {
        "tokenizer": {**settings["tokenizer"], "split": no_heldout},
        "data": {**settings["data"], "split": no_heldout},
    }
    tokenize_corpus("code", typed(TokenizeStage, settings), root / "tokenizer", tmp_path / "code")
    outputs = StageOutputs(tmp_path / "valset", tmp_path / "coverage.json", tmp_path / "heatmap.png")
    with pytest.raises(CoverageInfeasible) as err:
        build_valset(
            make_model(typed(ModelSettings, model_cfg), folder=root / "base"),
            [tmp_path / "code"],
            {
                "pool_corpora": ["code"],
                "min_docs_per_expert": 2,
                "min_tokens": 1,
                "pairs_per_layer": 2,
                "token_budget": 1500,
                "batch_tokens": 128,
            },
            outputs,
            "sdpa",
            seed=0,
        )
    assert str(err.value) == "the held-out pool of code has no documents: raise 'data.split.heldout'"
    assert not Path(outputs.valset).exists() and not Path(outputs.json).exists()


def test_a_held_out_pool_too_small_for_the_constraints(coverage_inputs, tmp_path):  # noqa: F811
    from moeflow.data.shards import open_split, read_documents

    root, model_cfg = coverage_inputs
    docs = len(dict(read_documents(open_split(root / "code", "heldout"))))
    with pytest.raises(CoverageInfeasible) as err:
        run_coverage_stage(root, model_cfg, tmp_path / "strict", min_docs_per_expert=docs + 1)
    assert not (tmp_path / "strict").exists()
    report, _ = run_coverage_stage(
        root, model_cfg, tmp_path / "allowed", min_docs_per_expert=docs + 1, allow_unmet=True
    )
    # every expert of both MoE layers (4 each) is short of documents, because the pool is
    assert all(u["reason"] == "pool" for u in report["unmet"])
    assert sum(u["constraint"].startswith("expert ") for u in report["unmet"]) == 2 * 4
    assert str(err.value) == (
        f"the held-out pool of code has {docs} document(s), fewer than 'coverage.min_docs_per_expert' ({docs + 1}), so "
        "no expert can be covered. " + infeasible_message(report["unmet"], docs + 1, 1)
    )
    assert str(err.value).endswith(
        "To proceed: add held-out documents to 'coverage.pool_corpora' or lower 'coverage.min_docs_per_expert'/"
        "'coverage.min_tokens'; or set 'coverage.allow_unmet: true' to record them as unmet instead."
    )


def test_esft_on_a_dense_model_an_unknown_family_or_fused_experts_under_fsdp1_is_refused():
    dense = config_error(train={"method": "esft"}, model={"config": {"num_experts": 0}})
    assert dense == (
        "invalid configuration: config key 'train.method': esft trains a task's routed experts, but the model is "
        "dense (num_experts=0): use train.method: full or lora"
    )
    llama = config_error(train={"method": "esft"}, model={"config": {"model_type": "llama"}})
    assert llama.startswith(
        "invalid configuration: config key 'train.method': esft scores and masks experts through a routing adapter, "
        "and model_type 'llama' has none (moeflow.families.registry.FAMILIES: qwen2_moe, "
    ) and llama.endswith("): use train.method: full or lora")
    fsdp = {
        "parallel": {"strategy": "fsdp", "nproc_per_node": 2},
        "hardware": {"num_devices": 2},
        "runs": {"dense": None},  # an ESFT run of a dense model is refused above
        "paper": {"dense_runs": []},
    }
    load(SMOKE, overrides={"train": {"method": "esft"}, **fsdp})  # FSDP2's DTensor rows, FSDP1's separate experts
    gpt_oss = {"config": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2}}
    if compat.fsdp2_available():
        load(SMOKE, overrides={"train": {"method": "esft"}, "model": gpt_oss, **fsdp})
    else:  # the pinned stack: FSDP1 over GPT-OSS's fused expert tensors
        assert config_error(train={"method": "esft"}, model=gpt_oss, **fsdp) == (
            "invalid configuration: config keys 'train.method': esft and 'parallel.strategy': fsdp do not combine "
            f"for gpt_oss's fused expert tensors on torch {compat.version_of('torch')}: FSDP1's flat shards split "
            "elements, not experts, so the unselected experts' rows cannot be masked. Use parallel.strategy: none, "
            "or STACK=current (FSDP2)"
        )
    assert config_error(train={"method": "esft", "balance": {"bias_update_rate": 0.001}}) == (
        "invalid configuration: config keys 'train.method': esft and 'train.balance.bias_update_rate' > 0 do not "
        "combine: ESFT keeps the routing frozen, and the loss-free bias update moves it. Set "
        "train.balance.bias_update_rate: 0"
    )
    assert config_error(train={"method": "esft", "esft": {"top_p": 0}}) == (
        "invalid configuration:\n  - config key 'train.esft.top_p': 0 is less than or equal to the minimum of 0\n"
        "(schema: config/schema.yaml)"
    )


def test_lora_under_expert_parallelism_refuses_a_router_adapter_a_quantized_base_and_experts_alone():
    ep = {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2}
    common = {"parallel": ep, "hardware": {"num_devices": 2}, "model": {"config": {"tie_word_embeddings": False}}}
    lora = {"method": "lora", "gradient_checkpointing": True}
    router = config_error(train=lora | {"lora": {"router": "adapter"}}, **common)
    assert (
        "config keys 'train.lora.router': adapter and 'parallel.strategy': ep do not combine: peft's wrapper would "
        "move the router out of the names transformers' expert-parallel plan reads. Use train.lora.router: frozen "
        "or trainable, or parallel.strategy: fsdp"
    ) in router
    experts_alone = config_error(train=lora | {"lora": {"targets": ["routed_experts"]}}, **common)
    assert (
        "config keys 'train.lora.targets': [routed_experts] and 'parallel.strategy': ep do not combine: under expert "
        "parallelism the experts' adapters go beside peft's, which need a module to adapt too. Add attention to "
        "train.lora.targets, or use parallel.strategy: fsdp"
    ) in experts_alone
    if compat.is_transformers_v5():
        load(SMOKE, overrides={"train": lora, "runs": {"dense": None}, "paper": {"dense_runs": []}, **common})


def test_cpu_offload_outside_fsdp2_is_refused_naming_the_keys():
    one_rank_fsdp = {"parallel": {"strategy": "fsdp", "cpu_offload": True}}
    if compat.fsdp2_available():
        load(SMOKE, overrides=one_rank_fsdp)  # a group of one
        load(SMOKE, overrides={"train": {"method": "lora", "gradient_checkpointing": True}, **one_rank_fsdp})
    else:
        assert config_error(**one_rank_fsdp) == (
            "invalid configuration: config key 'parallel.cpu_offload': true needs FSDP2's offload policy, and torch "
            f"{compat.version_of('torch')} runs FSDP1 here. Use STACK=current, or cpu_offload: false"
        )
    assert config_error(parallel={"cpu_offload": True}) == (
        "invalid configuration: config key 'parallel.cpu_offload': true needs parallel.strategy: fsdp (FSDP2's "
        "offload policy holds the sharded parameters, gradients and optimizer state on the host and streams each "
        "layer in); with one rank, fsdp shards over a group of one. Set parallel.strategy: fsdp, or cpu_offload: false"
    )
    ep = {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2, "cpu_offload": True}
    untied = {"config": {"tie_word_embeddings": False}}
    refusal = config_error(parallel=ep, hardware={"num_devices": 2}, model=untied)
    assert (
        "config keys 'parallel.cpu_offload': true and 'parallel.strategy': ep do not combine: under ep "
        "transformers makes the FSDP units, and moeflow does not turn its offload on (untested). Use "
        "parallel.strategy: fsdp"
    ) in refusal


def test_mtp_training_is_refused_without_mtp_layers_with_lora_esft_or_flash():
    train = {"mtp": {"mode": "train"}}
    assert config_error(train=train) == (
        "invalid configuration: config key 'train.mtp.mode': train needs a model with MTP layers (deepseek_v3, "
        "step3p5 with num_nextn_predict_layers > 0); model_type 'qwen3_moe' has none. Set train.mtp.mode: frozen"
    )
    deepseek = {"config": {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}}
    lora = config_error(train={**train, "method": "lora"}, model=deepseek)
    assert lora == (
        "invalid configuration: config key 'train.mtp.mode': train trains the MTP layers in full, and train.method "
        "is 'lora' (which leaves them frozen): use train.method: full, or train.mtp.mode: frozen"
    )
    assert "config key 'train.mtp.mode': train trains the MTP layers in full, and train.method is 'esft'" in (
        config_error(train={**train, "method": "esft"}, model=deepseek)
    )
    flash = config_error(train=train, model={**deepseek, "attn_implementation": "flash_attention_2"}, precision="bf16")
    assert flash == (
        "invalid configuration: config key 'train.mtp.mode': train: the MTP loss runs with eager or sdpa attention "
        "only, and model.attn_implementation is 'flash_attention_2': set model.attn_implementation: sdpa"
    )
    sharded = {"parallel": {"strategy": "fsdp", "nproc_per_node": 2}, "hardware": {"num_devices": 2}}
    load(
        SMOKE, overrides={"train": train, "model": deepseek, **sharded}
    )  # every layout (tests/unit/test_mtp_training.py)
    assert "pretrain.mtp.mode" in config_error(pretrain={"mtp": {"mode": "train"}})
    assert config_error(train={"mtp": {"loss_weight": -1}}).startswith(
        "invalid configuration:\n  - config key 'train.mtp.loss_weight': -1 is less than the minimum of 0"
    )
