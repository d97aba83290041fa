"""A QLoRA run through the Snakefile, next to a full run of the smoke pipeline: over an NF4 base (the smoke model
saved as a folder, its experts fused on transformers 5), it trains on 2 FSDP ranks, writes the peft adapter (gathered
from both) beside the merged model, evaluates the merged model, reaches the paper's LoRA-vs-full table, and a change
of LoRA settings reruns only its training stages and what follows them.

The smoke pipeline's ``moe`` run becomes the LoRA run (overlay), so the test retrains one run only and the
paper compares it with the smoke pipeline's full ``dense`` run. For CI's time the LoRA run has no lm-eval tasks
and no HumanEval (``runs.moe.evaluate``: 4 jobs of about 10 s each that the test never reads; the paper takes a
run without them, test_artifacts): its merged model is evaluated by evaluate_run and routing_drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    SERVE_PYTHON,
    SMOKE,
    only_on,
    phases_against_plan,
    results,
    scheduled_rules,
    snakemake,
    write_overlay,
)

pytestmark = [
    pytest.mark.pipeline,
    only_on(
        "current",
        "the Snakefile's LoRA wiring is the same on both; PEFT's training, merge and files: tests/unit/test_lora.py",
    ),
]
LORA = {"method": "lora", "gradient_checkpointing": True, "lora": {"rank": 4}}
# The LoRA run's layout: its adapters and frozen base sharded over 2 CPU ranks (FSDP2); its evaluation on one rank.
TWO_FSDP_RANKS = {"parallel": {"nproc_per_node": 2, "strategy": "fsdp"}, "hardware": {"num_devices": 2}}
NF4 = {"quantization": "nf4"}
NO_TASKS = {"tasks": [], "humaneval": {"enabled": False}}  # the LoRA run's: evaluate_run and routing_drift only
LORA_RUN, FULL_RUN = "moe", "dense"
JOB = re.compile(r"^(?:local)?rule (\w+):$")


def scheduled_jobs(workdir: Path, overlay: str, target: str = "paper") -> list[tuple[str, str]]:
    """(rule, outputs) of every job a dry run would execute."""
    return jobs_of(snakemake(workdir, target, "--dry-run", "--cores", "2", *SMOKE, overlay).stdout)


def jobs_of(out: str) -> list[tuple[str, str]]:
    """(rule, outputs) of every job listed in Snakemake's output: a dry run's stdout, or a run's log (stderr)."""
    jobs, rule = [], None
    for line in out.splitlines():
        match = JOB.match(line.strip())
        if match:
            rule = match.group(1)
        elif rule and line.strip().startswith("output:"):
            jobs.append((rule, line.split(":", 1)[1].strip()))
            rule = None
    return sorted(jobs)


def lora_overlay(workdir: Path, train: dict | None = None, **lora_run_train) -> str:
    run = TWO_FSDP_RANKS | {"model": NF4, "train": {**LORA, **lora_run_train}, "evaluate": NO_TASKS}
    return write_overlay(workdir, {"train": train or {}, "runs": {LORA_RUN: run}})


# with a serving environment, the merged QLoRA export is checked in vLLM, and its adapter as vLLM reads it (the smoke
# pipeline's serve.python)
SERVING = ("serve_check", "serving_adapter") if SERVE_PYTHON else ()
EVALUATION = ("evaluate_model", "evaluate_run", "routing_drift", *SERVING)


def only_the_lora_run(jobs: list[tuple[str, str]]) -> None:
    rules = {rule for rule, _ in jobs}
    assert rules <= {"paper", "plan_memory", "train_model", "warmup", "choose_experts", *EVALUATION}, jobs
    assert {"paper", "plan_memory", "train_model", "warmup", *EVALUATION} <= rules, jobs
    for rule, outputs in jobs:
        if rule in ("plan_memory", "train_model", *EVALUATION):
            assert f"/runs/{LORA_RUN}/" in outputs and f"/runs/{FULL_RUN}/" not in outputs, (rule, outputs)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_a_lora_run_trains_merges_evaluates_and_reruns_only_its_training_on_a_lora_change(pipeline_copy):
    from transformers import AutoModelForCausalLM

    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.lora import REPORT_FILE, load_adapter
    from moeflow.model.settings import ModelSettings
    from moeflow.paper.tables import read_csv_table
    from moeflow.settings import typed
    from moeflow.train.settings import TrainSettings
    from moeflow.workflow.keys import training

    overlay = lora_overlay(pipeline_copy)
    # what ran, from the run's own log (a dry run before it would cost a Snakemake start of CI time)
    only_the_lora_run(jobs_of(snakemake(pipeline_copy, "paper", "--cores", "2", *SMOKE, overlay).stderr))
    res = results(pipeline_copy)

    adapter = res / "runs" / LORA_RUN / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", REPORT_FILE} <= {p.name for p in adapter.iterdir()}
    report = json.loads((adapter / REPORT_FILE).read_text())
    assert report["method"] == "lora" and 0 < report["trainable"] < report["total"]
    full = json.loads((res / "runs" / FULL_RUN / "adapter" / REPORT_FILE).read_text())
    assert full["method"] == "full" and full["trainable"] == full["total"]
    phases_against_plan(res / "runs" / LORA_RUN)  # QLoRA on 2 FSDP ranks: every phase within the plan's tolerance

    base_dir = pipeline_copy / json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    load = dict(local_files_only=True, torch_dtype=torch.float32)
    # the trained model: the NF4 base as training loaded it, with the adapter the two ranks wrote
    quantized = typed(ModelSettings, {"config": {}, "experts_implementation": "eager", **NF4})
    lora = typed(TrainSettings, training({"steps": 1, "lr": 1e-3, **LORA}))
    base_nf4 = make_model(quantized, folder=base_dir, layout=Layout.single("cpu", lora))
    with_adapter = load_adapter(base_nf4, adapter)
    merged = AutoModelForCausalLM.from_pretrained(res / "runs" / LORA_RUN / "model", **load)
    ids = torch.randint(0, merged.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(merged, ids), logits(with_adapter, ids), rtol=0, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(base_dir, **load)
    assert (logits(merged, ids) - logits(base, ids)).abs().max() > 1e-6  # training moved the adapters
    evaluated = json.loads((res / "runs" / LORA_RUN / "eval" / "metrics.json").read_text())
    assert evaluated["parameters"]["total"] == sum(
        p.numel() for p in merged.parameters()
    )  # the merged model, no adapters

    if SERVE_PYTHON:  # the merged QLoRA export from 2 ranks serves as trained; vLLM's loader reads its adapter whole
        served = json.loads((res / "runs" / LORA_RUN / "serve" / "check.json").read_text())
        assert served["passed"] and served["max_abs_logprob_diff"] < 1e-4, served
        assert served["adapter"]["stacked_moe_layers"] == 2 and served["adapter"]["scaling"] == 32 / 4  # alpha / r
        assert (res / "runs" / LORA_RUN / "serve" / "adapter" / "adapter_model.safetensors").is_file()

    columns, rows = read_csv_table(res / "paper" / "tables" / "lora_vs_full.csv")
    by_run = {row[0]: dict(zip(columns, row)) for row in rows}
    assert set(by_run) == {LORA_RUN, FULL_RUN, f"{FULL_RUN} / {LORA_RUN}"}  # the ratio row of the other method
    assert by_run[LORA_RUN]["method"] == "lora" and by_run[LORA_RUN]["trainable params"] == str(report["trainable"])
    assert by_run[FULL_RUN]["method"] == "full" and by_run[FULL_RUN]["trainable params"] == str(full["trainable"])

    # LoRA settings key the LoRA run only: the full run's warmup, training and evaluation stay.
    assert scheduled_rules(pipeline_copy, overlay, target="paper") == set()
    only_the_lora_run(scheduled_jobs(pipeline_copy, lora_overlay(pipeline_copy, lora={"rank": 8})))
    only_the_lora_run(scheduled_jobs(pipeline_copy, lora_overlay(pipeline_copy, train={"lora": {"alpha": 8}})))
