"""The serving check through the Snakefile, on the smoke pipeline's exports (its serve.python, where a serving
environment is installed: tests/conftest.py): each run's record, the dense twin served as its dense architecture, the
report card's line, and a planted export defect failing the stage with nothing written."""

from __future__ import annotations

import json

import pytest
from conftest import SMOKE, active_stack, needs_serve_env, only_on, results, snakemake
from safetensors.torch import load_file, save_file

pytestmark = [needs_serve_env, only_on("current", "the stage's wiring is one; both stacks' smoke pipelines run it")]


@pytest.mark.fast
def test_every_export_of_the_smoke_pipeline_serves_as_trained(smoke_pipeline):
    res = results(smoke_pipeline)
    for run, model_type in (("moe", "qwen3_moe"), ("dense", "qwen3")):  # the dense twin as Qwen3
        record = json.loads((res / "runs" / run / "serve" / "check.json").read_text())
        assert record["checked"] and record["passed"] and record["model_type"] == model_type, record
        assert record["engine"] == "vllm" and record["dtype"] == "float32" and record["sequences"] > 10
        assert record["max_abs_logprob_diff"] < 1e-4 and record["top_token_agreement"] == 1.0
    card = (res / "report_card.md").read_text()
    assert card.count("- serving check, vllm ") == 2


def test_a_planted_export_defect_fails_the_stage_and_writes_nothing(pipeline_copy):
    res = results(pipeline_copy)
    weights = res / "runs" / "moe" / "model" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.router.weight"] = tensors.pop("model.layers.0.mlp.gate.weight")  # a renamed router
    save_file(tensors, weights, metadata={"format": "pt"})
    target = f"results/{active_stack()}/runs/moe/serve/check.json"
    failed = snakemake(pipeline_copy, target, "--forcerun", "serve_check", "--cores", "1", *SMOKE, check=False)
    assert failed.returncode != 0
    said = failed.stderr  # the stage's error, as Snakemake shows it
    assert "missing 1: model.layers.0.mlp.gate.weight" in said and "unexpected 1: model.layers.0.mlp.router" in said
    assert not (res / "runs" / "moe" / "serve" / "check.json").exists()


def test_humaneval_through_vllm_writes_the_hf_engines_greedy_completions(pipeline_copy):
    # evaluate.humaneval.engine: vllm on the smoke pipeline's fine-tuned model (the base goes the same way): the samples
    # in the same format, every greedy completion the HF engine's text (float32: the two pick the same tokens), the
    # sampled ones drawn by vLLM.
    res = results(pipeline_copy)
    samples = {model: res / "runs" / "moe" / "eval" / "humaneval" / model / "samples.jsonl" for model in ("finetuned",)}
    by_hf = {model: [json.loads(line) for line in path.read_text().splitlines()] for model, path in samples.items()}
    overlay = pipeline_copy / "config" / "engine.yaml"
    overlay.write_text(json.dumps({"evaluate": {"humaneval": {"engine": "vllm"}}}))
    targets = [str(path.relative_to(pipeline_copy)) for path in samples.values()]
    snakemake(pipeline_copy, *targets, "--cores", "2", *SMOKE, "config/engine.yaml")
    for model, path in samples.items():
        by_vllm = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(r["task_id"], r["mode"], r["index"]) for r in by_vllm] == [
            (r["task_id"], r["mode"], r["index"]) for r in by_hf[model]
        ]
        greedy = [(r, h) for r, h in zip(by_vllm, by_hf[model]) if r["mode"] == "greedy"]
        assert len(greedy) == 4 and all(r == h for r, h in greedy), (model, greedy)
        sampled = [r for r in by_vllm if r["mode"] != "greedy"]
        assert all(r["finish"] in ("stop", "eos", "length") and r["new_tokens"] <= 24 for r in sampled)
    log = (res / "logs" / "humaneval_generate").rglob("*.log")
    assert any("vllm" in p.read_text().lower() for p in log)


def test_lm_eval_through_vllm_gives_the_hf_engines_metrics(pipeline_copy):
    # evaluate.lm_eval.engine: vllm on the smoke pipeline's fine-tuned moe model: lm-eval's own vLLM backend scores the
    # exported folder. The perplexity equals the HF engine's (itself moeflow's evaluation, its cross-check says) to
    # float32 rounding: both score a segment from its first token, on the data stage's tokens. The body-choice
    # accuracies are the same fractions: no choice is a near tie in float32.
    res = results(pipeline_copy)
    folder = res / "runs" / "moe" / "eval" / "lm_eval" / "finetuned"
    by_hf = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    assert set(by_hf) == {"moeflow_perplexity", "moeflow_body_choice"}
    overlay = pipeline_copy / "config" / "engine.yaml"
    overlay.write_text(json.dumps({"evaluate": {"lm_eval": {"engine": "vllm"}}}))
    targets = [str((folder / f"{task}.json").relative_to(pipeline_copy)) for task in by_hf]
    snakemake(pipeline_copy, *targets, "--cores", "2", *SMOKE, "config/engine.yaml")
    for task, hf in by_hf.items():
        by_vllm = json.loads((folder / f"{task}.json").read_text())
        assert hf["engine"]["name"] == "hf" and by_vllm["engine"]["name"] == "vllm", by_vllm["engine"]
        assert by_vllm["engine"]["dtype"] == "float32" and by_vllm["lm_eval"] == hf["lm_eval"]
        assert by_vllm["num_samples"] == hf["num_samples"] > 0 and by_vllm["corpora"] == hf["corpora"]
        assert by_vllm["metrics"].keys() == hf["metrics"].keys()
        for metric, value in hf["metrics"].items():
            assert by_vllm["metrics"][metric]["value"] == pytest.approx(value["value"], rel=1e-5, abs=0), (task, metric)
    assert "cross_check" in by_hf["moeflow_perplexity"] and "cross_check" not in by_vllm
