"""The smoke pipeline through Snakemake: it finishes, reruns nothing when nothing changed, and reruns
exactly the stages a change invalidates."""

from __future__ import annotations

import json

import pytest
import rerun_expectations as E
from conftest import (
    SMOKE,
    SMOKE_SERVE_PYTHON,
    active_stack,
    in_smoke,
    results,
    scheduled_rules,
    snakemake,
    write_overlay,
)

pytestmark = [pytest.mark.pipeline, pytest.mark.fast]  # dry runs and reads of the smoke pipeline


def test_smoke_pipeline_produces_every_stage_output(smoke_pipeline):
    res = results(smoke_pipeline)
    report = json.loads((res / "env" / "report.json").read_text())
    assert report  # the environment report is real JSON with content
    assert (res / "env" / "report.md").read_text().strip()
    plan = json.loads((res / "runs" / "moe" / "plan.json").read_text())
    assert plan
    manifests = sorted(res.glob("data/d-*/*/manifest.json"))
    assert {m.parent.name for m in manifests} >= {"general", "target"}
    assert list(res.glob("coverage/c-*/coverage.json"))
    for rule in ("verify_env", "tokenize", "plan_memory"):
        assert list((res / "logs" / rule).rglob("*.log")), f"no log for {rule}"
        assert list((res / "benchmarks" / rule).rglob("*.tsv")), f"no benchmark for {rule}"


def test_smoke_pipeline_evaluates_tasks_humaneval_and_drift_into_the_paper(smoke_pipeline):
    res = results(smoke_pipeline)
    for model in ("base", "finetuned"):
        perplexity = json.loads((res / "runs/moe/eval/lm_eval" / model / "moeflow_perplexity.json").read_text())
        for corpus, check in perplexity["cross_check"].items():  # lm-eval agrees with moeflow's evaluation
            assert check["relative_difference"] < 1e-5, (model, corpus, check)
        humaneval = json.loads((res / "runs/moe/eval/humaneval" / model / "results.json").read_text())
        assert len(humaneval["problems"]) == 4 and set(humaneval["pass_at_k"]) == {"greedy", "sampled"}
    drift = json.loads((res / "runs/moe/eval/drift.json").read_text())
    assert len(drift["layers"]) == 2 and all(0 <= layer["js_divergence"] <= 1 for layer in drift["layers"])
    assert not (res / "runs/dense/eval/drift.json").exists()  # a dense model has no router
    forgetting = (res / "paper/tables/forgetting.md").read_text()
    assert "| moe |" in forgetting and "| dense |" in forgetting and "HumanEval greedy pass@1 change" in forgetting
    assert (res / "paper/figures/routing_drift.png").stat().st_size > 0


def test_an_up_to_date_pipeline_schedules_nothing(smoke_pipeline):
    assert scheduled_rules(smoke_pipeline) == set()
    assert scheduled_rules(smoke_pipeline, target="paper") == set()


def test_editing_a_figure_script_reruns_only_the_paper(pipeline_copy):
    script = pipeline_copy / "workflow" / "scripts" / "paper.py"
    script.write_text(script.read_text() + "\n# a change to the figures\n")
    assert scheduled_rules(pipeline_copy, target="paper") == {"paper"}


def test_verify_env_rerun_gives_identical_bytes_and_reruns_nothing_downstream(pipeline_copy):
    report = results(pipeline_copy) / "env"
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    snakemake(pipeline_copy, "verify_env", "--cores", "1", *SMOKE, "--forcerun", "verify_env")
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before
    assert scheduled_rules(pipeline_copy) == set()


def test_a_training_setting_reruns_the_plan_and_not_the_data_stages(pipeline_copy):
    rules = scheduled_rules(pipeline_copy, write_overlay(pipeline_copy, {"train": {"micro_batch_size": 3}}))
    assert "plan_memory" in rules
    assert not rules & {"verify_env", "train_tokenizer", "tokenize", "pretrain_base", "coverage_valset"}


def test_adding_a_run_schedules_only_that_runs_stages(pipeline_copy):
    rules = scheduled_rules(pipeline_copy, write_overlay(pipeline_copy, {"runs": {"hot": {"train": {"lr": 1e-3}}}}))
    assert {"plan_memory", "warmup", "train_model"} <= rules
    assert not rules & {"verify_env", "train_tokenizer", "tokenize", "pretrain_base", "coverage_valset"}


# docs/reruns.md's table of setting and file changes, one row per case: a change, and exactly the stages it
# schedules (target paper).
# plan_memory reads the model, tokenizer.vocab_size and the training settings, not the data.
# Every evaluation stage reads the fine-tuned model.
EVALUATION = {*E.EVALUATION, "paper"}
TRAINING = {"plan_memory", "warmup", "train_model"} | EVALUATION | E.SERVING  # serve_check reads the export
ALL_RULES = set(E.RULE_ORDER)  # the smoke pipeline's rules
RERUN_TABLE = {
    "tokenizer setting": (
        {"tokenizer": {"min_frequency": 3}},
        {"train_tokenizer", "tokenize", "pretrain_base", "coverage_valset"} | TRAINING - {"plan_memory"},
    ),
    # The tokenizer is trained on every corpus, so a corpus change retrains it and the base model too.
    "data path": (
        {"data": {"sources": {"target": {"packages": ["email"]}}}},
        {"train_tokenizer", "tokenize", "pretrain_base", "coverage_valset"} | TRAINING - {"plan_memory"},
    ),
    "coverage setting": (
        {"coverage": {"token_budget": 8192}},
        {"coverage_valset", "train_model"} | EVALUATION | E.SERVING,
    ),
    # The coverage stage's own layout: no part of the coverage key, so its params start it again (same outputs).
    "coverage layout": (
        {"coverage": {"strategy": "fsdp"}},
        {"coverage_valset", "train_model"} | EVALUATION | E.SERVING,
    ),
    "peak learning rate": ({"train": {"lr": 1e-3}}, TRAINING),
    "total steps": ({"train": {"steps": 10}}, TRAINING - {"warmup"}),
    # The experts implementation is timed at the micro-batch's token count.
    "micro-batch size": ({"train": {"micro_batch_size": 3}}, TRAINING | {"choose_experts"}),
    "evaluation setting": (
        {"evaluate": {"max_sequences": 4}},
        {"evaluate_model", "evaluate_run", "routing_drift", "paper"},
    ),
    # The export's settings are part of train_model's settings param only (no part of the checkpoints' key).
    "export setting": ({"export": {"max_shard_size": "1GB"}}, TRAINING - {"plan_memory", "warmup"}),
    # Evaluation's own layout (the forward-only stages after training): training and coverage are reused.
    "evaluation layout": ({"evaluate": {"strategy": "fsdp"}}, EVALUATION),
    # Each lm-eval task of each model is its own job: dropping one reruns none of the others.
    "lm-eval task list": ({"evaluate": {"tasks": ["moeflow_perplexity"]}}, {"paper"}),
    "lm-eval setting": ({"evaluate": {"lm_eval": {"batch_size": 2}}}, {"lm_eval_task", "paper"}),
    "HumanEval sandbox setting": ({"evaluate": {"humaneval": {"timeout_s": 3.0}}}, {"humaneval_execute", "paper"}),
    "HumanEval sampling setting": (
        {"evaluate": {"humaneval": {"temperature": 0.5}}},
        {"humaneval_generate", "humaneval_execute", "paper"},
    ),
    "figure style": ({"paper": {"dpi": 100}}, {"paper"}),
    # The runtime settings that change numbers (common.smk's runtime): torch's threads split its reductions, so
    # every rule that computes with torch reruns, and what reads its outputs; the data stages do not.
    # (The planner reads no timing; precision and seed are recorded by every rule, verify_env's report included.)
    "threads": ({"threads": 2}, ALL_RULES - {"verify_env", "train_tokenizer", "tokenize", "plan_memory"}),
    "precision": ({"precision": "bf16"}, ALL_RULES),
    "seed": ({"seed": 1}, ALL_RULES),
}
if SMOKE_SERVE_PYTHON:  # the serving check's own settings (without a serving environment no job reads them)
    RERUN_TABLE["serving setting"] = ({"serve": {"tolerance": 1.0e-3}}, {"serve_check", "paper"})


@pytest.mark.parametrize("change", sorted(RERUN_TABLE))
def test_rerun_table(pipeline_copy, change):
    overlay, expected = RERUN_TABLE[change]
    assert scheduled_rules(pipeline_copy, write_overlay(pipeline_copy, overlay), target="paper") == in_smoke(expected)


def test_editing_the_environment_file_reruns_the_stages_that_read_its_report(pipeline_copy):
    env_file = pipeline_copy / "envs" / f"{active_stack()}.yaml"
    env_file.write_text(env_file.read_text() + "\n# an edit\n")
    expected = {"verify_env", "plan_memory", "train_model"} | EVALUATION | E.SERVING
    assert scheduled_rules(pipeline_copy, target="paper") == in_smoke(expected)


def test_stacks_write_to_separate_result_trees(smoke_pipeline):
    other = "current" if active_stack() == "pinned" else "pinned"
    assert not (smoke_pipeline / "results" / other).exists()
    out = snakemake(smoke_pipeline, "verify_env", "--dry-run", "--cores", "1", *SMOKE, env={"STACK": other}).stdout
    assert f"results/{other}/env/report.json" in out
