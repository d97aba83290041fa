"""The config: schema errors name the key, runs are validated overlays, keys are shared where settings agree."""

from __future__ import annotations

import pytest

from moeflow import config as mfconfig

SMOKE = mfconfig.REPO_ROOT / "config" / "smoke.yaml"


def test_default_and_smoke_configs_are_valid():
    for cfg in (mfconfig.load(), mfconfig.load(SMOKE)):
        assert mfconfig.run_names(cfg) == ["moe", "dense"]
        mfconfig.run_config(cfg, "moe")
        dense = mfconfig.run_config(cfg, "dense")["model"]["config"]  # the MoE's active parameters per token
        moe = cfg["model"]["config"]
        assert dense["num_experts"] == 0 and dense["intermediate_size"] == moe["num_experts_per_tok"] * moe["moe_intermediate_size"]


def test_wrong_type_names_the_key():
    with pytest.raises(mfconfig.ConfigError) as err:
        mfconfig.load(overrides={"data": {"seq_len": "long"}})
    assert "config key 'data.seq_len': 'long' is not of type 'integer'" in str(err.value)


def test_out_of_range_value_names_the_key():
    with pytest.raises(mfconfig.ConfigError) as err:
        mfconfig.load(overrides={"threads": 0})
    assert "config key 'threads': 0 is less than the minimum of 1" in str(err.value)


def test_unknown_key_names_it_and_lists_the_allowed_keys():
    with pytest.raises(mfconfig.ConfigError) as err:
        mfconfig.load(overrides={"coverage": {"min_doc_per_expert": 5}})
    message = str(err.value)
    assert "config key 'coverage': unknown key(s) 'min_doc_per_expert'" in message
    assert "min_docs_per_expert" in message  # the allowed keys are listed


def test_enum_lists_the_allowed_values():
    with pytest.raises(mfconfig.ConfigError) as err:
        mfconfig.load(overrides={"precision": "fp16"})
    assert "config key 'precision': 'fp16' is not one of the allowed values ('fp32', 'bf16')" in str(err.value)


def test_a_bad_run_overlay_is_reported_with_the_run_name():
    with pytest.raises(mfconfig.ConfigError) as err:
        mfconfig.load(overrides={"runs": {"wide": {"data": {"seq_len": -4}}}})
    assert "(run 'wide')" in str(err.value) and "data.seq_len" in str(err.value)


def test_run_names_are_restricted_to_path_safe_characters():
    with pytest.raises(mfconfig.ConfigError, match="run names may use"):
        mfconfig.load(overrides={"runs": {"../escape": {}}})


def test_unknown_corpus_reference_is_refused():
    with pytest.raises(mfconfig.ConfigError, match="corpus 'nope' is not among 'data.sources'"):
        mfconfig.load(overrides={"data": {"eval_corpora": ["nope"]}})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(mfconfig.ConfigError, match="does not exist"):
        mfconfig.load(tmp_path / "absent.yaml")


def test_runs_overlay_the_base_and_share_what_they_agree_on():
    cfg = mfconfig.load(
        overrides={"runs": {"moe": {}, "lr_variant": {"train": {"micro_batch_size": 4}}, "short": {"data": {"seq_len": 256}}}}
    )
    moe, lr_variant, short = (mfconfig.run_config(cfg, r) for r in ("moe", "lr_variant", "short"))
    assert lr_variant["train"]["micro_batch_size"] == 4 and moe["train"]["micro_batch_size"] == 2
    # a training setting does not change the data stages' keys ...
    assert mfconfig.data_key(moe) == mfconfig.data_key(lr_variant)
    assert mfconfig.coverage_key(moe) == mfconfig.coverage_key(lr_variant)
    # ... a data setting does, but the tokenizer (trained before packing) is still shared
    assert mfconfig.data_key(moe) != mfconfig.data_key(short)
    assert mfconfig.tokenizer_key(moe) == mfconfig.tokenizer_key(short)


def test_stable_hash_ignores_key_order():
    assert mfconfig.stable_hash({"a": 1, "b": [1, 2]}) == mfconfig.stable_hash({"b": [1, 2], "a": 1})


def test_stack_comes_from_config_then_environment():
    cfg = mfconfig.load()
    assert mfconfig.resolve_stack(cfg, environ={}) == "pinned"
    assert mfconfig.resolve_stack(cfg, environ={"STACK": "current"}) == "current"
    assert mfconfig.resolve_stack({**cfg, "stack": "pinned"}, environ={"STACK": "current"}) == "pinned"
    with pytest.raises(mfconfig.ConfigError, match="must be one of pinned, current"):
        mfconfig.resolve_stack(cfg, environ={"STACK": "nightly"})
