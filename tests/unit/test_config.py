"""The configuration (moeflow.workflow and moeflow.settings): schema errors name the key, runs are validated
overlays, the schema's defaults are the only defaults, typed settings per stage, and keys shared where settings
agree."""

from __future__ import annotations

import json

import pytest

from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, ConfigError, enum, plain, resolved, schema, typed, with_defaults
from moeflow.train.settings import (
    BalanceSettings,
    LoraSettings,
    PretrainStage,
    RoutingThresholds,
    TrainModelStage,
    TrainSettings,
    WarmupStage,
)
from moeflow.workflow.keys import (
    base_model_settings,
    coverage_key,
    data_key,
    experts_key,
    stable_hash,
    tokenizer_key,
    train_model_settings,
    train_settings,
    training,
    warmup_settings,
)
from moeflow.workflow.load import load, resolve_stack, run_config
from moeflow.workflow.merge import resolved_precision, run_names

SMOKE = REPO_ROOT / "config" / "smoke.yaml"


def optional_keys_without_default(node, path=""):
    """Keys the schema lets a config leave out but gives no default (a source's keys per kind count)."""
    node = resolved(node)
    branches = [(node.get(b) or {}).get("properties") or {} for b in ("then", "else")]
    per_kind = {k for props in branches for k, v in props.items() if "default" in v}
    missing = []
    for key, sub in (node.get("properties") or {}).items():
        target = resolved(sub)
        if key not in node.get("required", []) and "default" not in target and key not in per_kind:
            missing.append(f"{path}.{key}")
        if "properties" in target or isinstance(target.get("additionalProperties"), dict):
            missing += optional_keys_without_default(sub, f"{path}.{key}")
    others = node.get("additionalProperties")
    if isinstance(others, dict) and "properties" in resolved(others):
        missing += optional_keys_without_default(others, f"{path}.*")
    return missing


def test_every_optional_key_has_its_default_in_the_schema():
    # a file source's path has none: the file kinds require it and stdlib takes none
    assert optional_keys_without_default(schema()) == [".data.sources.*.path"]


def test_defaults_fill_in_through_refs_and_per_source_kind():
    filled = with_defaults(
        {
            "train": {"steps": 3, "lr": 1.0, "balance": {"coef": 0.5}},
            "data": {"sources": {"code": {"type": "stdlib"}, "chat": {"type": "jsonl", "path": "c.jsonl"}}},
        }
    )
    assert filled["train"]["balance"] == {"coef": 0.5, "mode": "running", "z_loss_coef": 0.0, "bias_update_rate": 0.0}
    assert filled["train"]["routing_guard"]["window_steps"] == 10 and filled["train"]["betas"] == [0.9, 0.95]
    assert filled["data"]["sources"]["code"] == {"type": "stdlib", "packages": None, "exclude_packages": []}
    assert filled["data"]["sources"]["chat"] == {
        "type": "jsonl",
        "path": "c.jsonl",
        "text_field": "text",
        "messages_field": None,
        "assistant_only_labels": True,
    }
    assert filled["parallel"]["strategy"] == "none" and filled["env"] == {"strict": False}
    # keys present, null included, are kept
    assert with_defaults({"hardware": {"num_devices": None}})["hardware"] == {
        "num_devices": None,
        "device": "cpu",
        "memory_gib_per_device": None,
    }


def test_a_runs_overlay_gets_the_defaults_too():
    cfg = load(
        SMOKE,
        overrides={
            "runs": {
                "wide": {
                    "parallel": {"strategy": "fsdp", "nproc_per_node": 2},
                    "hardware": {"num_devices": 2},
                    "data": {
                        "sources": {"notes": {"type": "text", "path": "notes/"}}
                    },  # a source the base does not have
                }
            }
        },
    )
    wide = run_config(cfg, "wide")
    assert wide["parallel"] == {
        "strategy": "fsdp",
        "nproc_per_node": 2,
        "nnodes": 1,
        "ep_size": 1,
        "fsdp_size": None,
        "ep_implementation": "auto",
        "cpu_offload": False,
    }
    assert wide["data"]["sources"]["notes"]["assistant_only_labels"] is True


def test_enumerations_are_read_from_the_schema():
    assert enum("#/$defs/balance/properties/mode") == ("running", "exact", "micro_batch", "off", False)
    lora = typed(LoraSettings, {"targets": ["all"]})
    assert lora.categories == ("attention", "dense_ffn", "shared_experts", "routed_experts")


def test_training_settings_resolve_the_warmup_and_drop_lora_of_a_full_run():
    train = training({"steps": 40, "lr": 1e-3, "warmup_ratio": 0.2, "balance": {"mode": False}})
    settings = typed(TrainSettings, train)
    assert settings.warmup_steps == 8 and settings.lora is None and settings.balance.mode == "off"
    assert isinstance(settings.betas, tuple)
    assert settings.routing_guard == RoutingThresholds(10, 3.0, 0.6, 0, 50, 0.5, 0.5, "base", 1.5, 0.15)
    lora = typed(TrainSettings, training({"steps": 4, "lr": 1e-3, "method": "lora"}))
    assert lora.lora == LoraSettings(rank=16, alpha=32.0, dropout=0.0, targets=("all",), router="frozen")


def test_typed_settings_need_every_key_and_know_them_all():
    with pytest.raises(ConfigError, match=r"missing \['data'"):
        typed(PretrainStage, {"model": {}, "pretrain": {}, "precision": "fp32", "seed": 0})
    with pytest.raises(ConfigError, match=r"unknown \['extra'\]"):
        typed(BalanceSettings, {"coef": 0.1, "extra": 1})


@pytest.mark.parametrize(
    "stage,settings_of",
    [
        (PretrainStage, base_model_settings),
        (WarmupStage, warmup_settings),
        (TrainModelStage, train_model_settings),
    ],
)
def test_stage_params_are_plain_whole_and_type_back(stage, settings_of):
    cfg = run_config(load(SMOKE), "moe")
    params = settings_of(cfg)
    assert json.loads(json.dumps(params)) == params  # what Snakemake compares to decide a rerun
    stage_settings = typed(stage, params)
    assert plain(stage_settings) == json.loads(json.dumps(params))


def test_the_warmup_stage_trains_the_warmup_part_only():
    cfg = run_config(load(SMOKE), "moe")
    warmup = typed(WarmupStage, warmup_settings(cfg)).train
    assert (warmup.steps, warmup.warmup_steps) == (cfg["train"]["warmup_steps"],) * 2
    assert (warmup.min_lr, warmup.log_every, warmup.eval_every, warmup.peak_flops_per_s) == (0.0, 1, 0, None)
    whole = typed(TrainModelStage, train_model_settings(cfg)).train
    assert whole.steps == cfg["train"]["steps"] and whole.routing_guard == warmup.routing_guard


def test_the_training_layout_rekeys_the_runs_experts_choice_but_not_the_base_models():
    """pretrain_base holds the whole model on every rank whatever parallel says (its key has no parallel), so its
    experts choice is timed in that layout: a run on FSDP ranks reruns neither the choice nor the base model."""
    cfg = run_config(load(SMOKE), "moe")
    fsdp = {**cfg, "parallel": {**cfg["parallel"], "strategy": "fsdp", "nproc_per_node": 2}}
    assert experts_key(fsdp, "train") != experts_key(cfg, "train")
    assert experts_key(fsdp, "pretrain") == experts_key(cfg, "pretrain")
    assert base_model_settings(fsdp) == base_model_settings(cfg)


# --------------------------------------------------------------------------- overlays


def test_null_in_an_overlay_removes_a_key_or_a_run():
    cfg = load(
        overrides={
            "train": {"warmup_steps": None, "warmup_ratio": 0.25},
            "runs": {"dense": None, "esft": None},
            "paper": {"dense_runs": []},
        }
    )
    assert run_names(cfg) == ["moe", "lora", "moe-seed2"]
    assert train_settings(cfg)["warmup_steps"] == 10  # 0.25 x 40 steps: the default's 8 is gone
    with pytest.raises(
        ConfigError,
        match=r"'paper.moe_run' / 'paper.dense_runs': 'dense' is not a run \(moe, lora, esft, moe-seed2\)",
    ):
        load(overrides={"runs": {"dense": None}})


def test_a_source_of_another_type_replaces_the_one_below_whole(tmp_path):
    cfg = load(overrides={"data": {"sources": {"target": {"type": "jsonl", "path": str(tmp_path / "t.jsonl")}}}})
    assert cfg["data"]["sources"]["target"] == {
        "type": "jsonl",
        "path": str(tmp_path / "t.jsonl"),
        "text_field": "text",
        "messages_field": None,
        "assistant_only_labels": True,
    }
    same_type = load(overrides={"data": {"sources": {"target": {"type": "stdlib", "exclude_packages": ["xml"]}}}})
    assert same_type["data"]["sources"]["target"]["packages"] == ["email", "http", "urllib", "json", "xml", "html"]


def test_keys_of_another_kind_of_source_are_a_config_error():
    with pytest.raises(ConfigError) as err:
        load(overrides={"data": {"sources": {"notes": {"type": "jsonl", "path": "n.jsonl", "packages": ["json"]}}}})
    assert str(err.value) == (
        "invalid configuration: config key 'data.sources.notes': "
        "packages do not apply to a source of type jsonl; remove them"
    )


def test_a_hub_id_as_model_pretrained_says_how_to_fetch_it():
    with pytest.raises(ConfigError) as err:
        load(overrides={"model": {"pretrained": "Qwen/Qwen3-30B-A3B"}})
    message = str(err.value)
    assert "config key 'model.pretrained': 'Qwen/Qwen3-30B-A3B' is not a local model folder" in message
    assert "moeflow never downloads a model" in message
    assert "`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir models/qwen3-30b-a3b`" in message
    assert message.endswith("then set model.pretrained: models/qwen3-30b-a3b")


def test_a_pretrained_model_gets_only_its_own_runs(tmp_path):
    """The embedded default's dense comparison (model_from_config) changes model.config: a pretrained folder
    has no model.config to change, so it is not there for one."""
    pretrained = load(overrides={"model": {"pretrained": str(tmp_path)}})
    assert run_names(pretrained) == ["moe"] and pretrained["paper"]["dense_runs"] == []
    assert pretrained["paper"]["noise_run"] is None
    assert "model_from_config" not in pretrained and "model_from_config" not in load()
    # the smoke overlay's change to the dense run lands on the embedded default's
    assert run_config(load(SMOKE), "dense")["model"]["config"]["num_experts"] == 0


def test_a_run_that_changes_model_config_of_a_pretrained_model_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(
            overrides={
                "model": {"pretrained": str(tmp_path)},
                "runs": {"narrow": {"model": {"config": {"intermediate_size": 64}}}},
            }
        )
    assert str(err.value).startswith(
        "invalid configuration: config key 'runs.narrow.model.config': run 'narrow' changes model.config, but "
        "model.pretrained is set"
    )
    with pytest.raises(ConfigError, match="run 'own' changes model.config"):  # the run's own pretrained folder
        load(overrides={"runs": {"own": {"model": {"pretrained": str(tmp_path), "config": {"hidden_size": 64}}}}})


# --------------------------------------------------------------------------- validation and keys


def test_default_and_smoke_configs_are_valid():
    for cfg, runs in ((load(), ["moe", "dense", "lora", "esft", "moe-seed2"]), (load(SMOKE), ["moe", "dense"])):
        assert run_names(cfg) == runs
        full = run_config(cfg, "moe")
        for method in set(runs) & {"lora", "esft"}:  # the methods comparison: the same base, data and token budget
            run = run_config(cfg, method)
            assert run["train"]["method"] == method and full["train"]["method"] == "full"
            assert run["model"] == full["model"] and run["data"] == full["data"] and run["pretrain"] == full["pretrain"]
            assert {k: run["train"][k] for k in ("steps", "micro_batch_size", "grad_accum_steps")} == {
                k: full["train"][k] for k in ("steps", "micro_batch_size", "grad_accum_steps")
            }
        dense = run_config(cfg, "dense")["model"]["config"]  # the MoE's active parameters per token
        moe = cfg["model"]["config"]
        assert (
            dense["num_experts"] == 0
            and dense["intermediate_size"] == moe["num_experts_per_tok"] * moe["moe_intermediate_size"]
        )


def test_the_defaults_noise_run_is_the_moe_run_reseeded_from_its_base_model_on():
    """paper.noise_run: the moe run with another seed, so its distance from moe is the seed noise of the base model's
    pretraining and of the fine-tune together, on the same data, splits and validation set."""
    cfg = load()
    assert cfg["paper"]["noise_run"] == "moe-seed2" and load(SMOKE)["paper"]["noise_run"] is None
    moe, twin = run_config(cfg, "moe"), run_config(cfg, "moe-seed2")
    assert (moe["seed"], twin["seed"]) == (1234, 1235) and twin["coverage"]["valset_of_run"] == "moe"
    assert data_key(twin) == data_key(moe) and tokenizer_key(twin) == tokenizer_key(moe)  # the same splits
    assert base_model_settings(twin) != base_model_settings(moe)  # pretrained again
    assert warmup_settings(twin)["seed"] == 1235 != warmup_settings(moe)["seed"]  # the fine-tune reseeded
    assert {**twin, "seed": 1234, "coverage": moe["coverage"]} == moe


def test_a_noise_run_that_is_missing_or_differs_in_more_than_its_seed_is_refused():
    def refusal(**overrides) -> str:
        with pytest.raises(ConfigError) as err:
            load(overrides=overrides)
        return str(err.value)

    off = "or set paper.noise_run: null (the paper then says the seed noise was not measured)"
    assert refusal(runs={"moe-seed2": None}) == (
        "invalid configuration: config key 'paper.noise_run': 'moe-seed2' is not a run (moe, dense, lora, esft): add "
        f"the run, moe_run with another seed, {off}"
    )
    assert refusal(runs={"moe-seed2": {"train": {"steps": 20}, "data": {"seq_len": 256}}}) == (
        "invalid configuration: config key 'paper.noise_run': 'moe-seed2' must differ from paper.moe_run 'moe' in its "
        "seed only (and coverage.valset_of_run), but it also differs in data.seq_len, train.steps: make it 'moe' "
        f"with another seed, {off}"
    )
    assert "also differs in train.lr, train.method, train.min_lr:" in refusal(paper={"noise_run": "lora"})
    assert refusal(runs={"moe-seed2": {"seed": 1234}}) == (
        "invalid configuration: config key 'paper.noise_run': 'moe-seed2' has the seed of paper.moe_run 'moe': give "
        f"it another seed, {off}"
    )
    assert refusal(paper={"noise_run": "moe"}) == (
        "invalid configuration: config key 'paper.noise_run': 'moe' is paper.moe_run itself: name a run that is "
        f"'moe' with another seed, {off}"
    )
    load(overrides={"runs": {"moe-seed2": None}, "paper": {"noise_run": None}})  # the noise unmeasured: accepted
    load(overrides={"runs": {"again": {"seed": 7}}, "paper": {"noise_run": "again"}})  # its own valset: accepted


def test_stepfuns_recipe_sets_their_values_with_a_source_on_every_line():
    """config/recipes/step3p5-flash-sft.yaml: StepFun's SFT values in moeflow's keys, each line saying where it
    comes from or what moeflow does instead; a valid overlay (the pinned stack refuses the model folder it is
    used with: tests/pipeline/test_step3p5_pipeline.py)."""
    path = REPO_ROOT / "config" / "recipes" / "step3p5-flash-sft.yaml"
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):  # a value
            assert "#" in line and ("StepFun" in line or "moeflow" in line), f"{path.name}:{number}: {line}"
    others = {"runs": {"dense": None, "lora": None, "esft": None}, "paper": {"dense_runs": []}}  # LoRA: no Muon
    if not compat.torch_has_muon():  # Muon, as StepFun trains: the current stack's (so is the model)
        with pytest.raises(ConfigError, match="muon needs torch.optim.Muon.*STACK=current"):
            load(path, overrides=others)
        return
    train = run_config(load(path, overrides=others), "moe")["train"]
    assert (train["method"], train["optimizer"], train["order"]) == ("full", "muon", "sequential")
    assert (train["lr"], train["min_lr"], train["warmup_steps"], train["weight_decay"]) == (1e-5, 5e-6, 140, 0.1)
    assert train["balance"]["coef"] == 0 and train["balance"]["bias_update_rate"] == 0
    assert train["gradient_checkpointing"] and "Muon" in path.read_text()


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError) as err:
        load(overrides={"data": {"seq_len": "long"}})
    assert "config key 'data.seq_len': 'long' is not of type 'integer'" in str(err.value)


def test_out_of_range_value_names_the_key():
    with pytest.raises(ConfigError) as err:
        load(overrides={"threads": 0})
    assert "config key 'threads': 0 is less than the minimum of 1" in str(err.value)


def test_unknown_key_names_it_and_lists_the_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load(overrides={"coverage": {"min_doc_per_expert": 5}})
    message = str(err.value)
    assert "config key 'coverage': unknown key(s) 'min_doc_per_expert'" in message
    assert "min_docs_per_expert" in message  # the allowed keys are listed


def test_enum_lists_the_allowed_values():
    with pytest.raises(ConfigError) as err:
        load(overrides={"precision": "fp16"})
    assert "config key 'precision': 'fp16' is not one of the allowed values ('auto', 'fp32', 'bf16')" in str(err.value)


def test_a_bad_run_overlay_is_reported_with_the_run_name():
    with pytest.raises(ConfigError) as err:
        load(overrides={"runs": {"wide": {"data": {"seq_len": -4}}}})
    assert "(run 'wide')" in str(err.value) and "data.seq_len" in str(err.value)


def test_run_names_are_restricted_to_path_safe_characters():
    with pytest.raises(ConfigError, match="run names may use"):
        load(overrides={"runs": {"../escape": {}}})


def test_unknown_corpus_reference_is_refused():
    with pytest.raises(ConfigError, match="corpus 'nope' is not among 'data.sources'"):
        load(overrides={"data": {"eval_corpora": ["nope"]}})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "absent.yaml")


def test_runs_overlay_the_base_and_share_what_they_agree_on():
    cfg = load(
        overrides={
            "runs": {"moe": {}, "lr_variant": {"train": {"micro_batch_size": 4}}, "short": {"data": {"seq_len": 256}}}
        }
    )
    moe, lr_variant, short = (run_config(cfg, r) for r in ("moe", "lr_variant", "short"))
    assert lr_variant["train"]["micro_batch_size"] == 4 and moe["train"]["micro_batch_size"] == 2
    # a training setting does not change the data stages' keys ...
    assert data_key(moe) == data_key(lr_variant)
    assert coverage_key(moe) == coverage_key(lr_variant)
    # ... a data setting does, but the tokenizer (trained before packing) is still shared
    assert data_key(moe) != data_key(short)
    assert tokenizer_key(moe) == tokenizer_key(short)


def test_stable_hash_ignores_key_order():
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})


def test_stack_comes_from_config_then_environment():
    cfg = load()
    assert resolve_stack(cfg, environ={}) == "pinned"
    assert resolve_stack(cfg, environ={"STACK": "current"}) == "current"
    assert resolve_stack({**cfg, "stack": "pinned"}, environ={"STACK": "current"}) == "pinned"
    with pytest.raises(ConfigError, match="must be one of pinned, current"):
        resolve_stack(cfg, environ={"STACK": "nightly"})


def test_precision_auto_is_fp32_on_the_cpu_and_bf16_on_cuda():
    assert load()["precision"] == "fp32"  # the CPU results and stage keys of before
    assert load(overrides={"hardware": {"device": "cuda"}})["precision"] == "bf16"
    cuda = load(overrides={"hardware": {"device": "cuda"}, "precision": "fp32"})
    assert cuda["precision"] == "fp32"  # an explicit precision wins
    assert all(run_config(cuda, run)["precision"] == "fp32" for run in run_names(cuda))
    assert resolved_precision({"precision": "auto", "hardware": {"device": "cuda"}}) == "bf16"


def test_flash_attention_in_fp32_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match="'model.attn_implementation': flash_attention_2 and 'precision': fp32"):
        load(overrides={"model": {"attn_implementation": "flash_attention_2"}})
    on_cuda = {"model": {"attn_implementation": "flash_attention_2"}, "hardware": {"device": "cuda"}}
    assert load(overrides=on_cuda)["precision"] == "bf16"


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="Step-3.5-Flash is a current-stack model")
def test_flash_attention_for_a_family_without_it_is_refused_naming_sdpa():
    """#36 item 5: transformers marks Step-3.5's attention as not supporting flash-attn; the load would fail."""
    from tiny_models import model_config

    model = {**model_config("step3p5"), "attn_implementation": "flash_attention_2"}
    with pytest.raises(ConfigError, match=r"flash_attention_2 cannot load step3p5.*Use sdpa"):
        load(overrides={"model": model, "hardware": {"device": "cuda"}})
    from moeflow.families.step3p5.modeling import Step3p5ForCausalLM

    assert Step3p5ForCausalLM._supports_flash_attn is False  # what the refusal stands for


def test_runs_that_share_a_keyed_stage_must_agree_on_what_it_reads():
    """Two runs with one coverage key share its job: a layout they disagree on is refused naming both runs."""
    from moeflow.workflow.rule_settings import configs_by_key

    cfg = load(overrides={"runs": {"a": {}, "b": {"train": {"steps": 9}}, "c": {"coverage": {"ranks": 2}}}})
    runs = {name: run_config(cfg, name) for name in ("a", "b")}
    assert list(configs_by_key("covkey", runs).values()) == [runs["a"]]  # train.steps is no part of it
    assert len(configs_by_key("warmkey", runs)) == 1
    runs["c"] = run_config(cfg, "c")
    with pytest.raises(ConfigError, match=r"runs 'a' and 'c' share rule coverage_valset's output c-\w+ .*parallel"):
        configs_by_key("covkey", runs)


def test_a_torchrun_jobs_settings_are_compared_as_a_dict_and_passed_as_json():
    """Snakemake's params trigger compares repr(); the shell command line formats str()."""
    from moeflow.runtime.job import Job
    from moeflow.workflow.rule_settings import CommandLineJson, rule_settings

    cfg = run_config(load(), "moe")
    settings = CommandLineJson(rule_settings("train_model", cfg, {"run": "moe"}, cfg))
    assert repr(settings) == repr(dict(settings)) and json.loads(str(settings)) == settings
    argv = ["--job", json.dumps({"rule": "train_model", "input": {}, "output": {}, "params": {"checkpoints": "c"}})]
    argv += ["--settings", str(settings), "--runtime", json.dumps({"precision": "fp32"}), "--threads", "1"]
    job = Job.from_argv(TrainModelStage, argv)
    assert job.params.checkpoints == "c" and job.params.runtime == {"precision": "fp32"}
    assert job.settings == typed(TrainModelStage, settings) and job.settings.export == cfg["export"]
