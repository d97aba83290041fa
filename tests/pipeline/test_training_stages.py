"""The training stage scripts (warmup, train_model) started as their rules start them, and training
through Snakemake on the smoke config: a second-part setting, a killed train_model resuming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import packed_rows  # noqa: E402

from moeflow.loading.factory import make_model
from moeflow.model.experts_choice import choice_record, measure
from moeflow.model.settings import ModelSettings
from moeflow.runtime.files import write_json
from moeflow.runtime.stage import KILL_ENV
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import train_model_settings, warmup_settings
from moeflow.workflow.load import load, run_config

# --------------------------------------------------------------------------- the stage scripts


SCRIPTS = REPO_ROOT / "workflow" / "scripts"
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--monitor-interval",
    "0.5",
    "--nproc_per_node",
    "1",
]


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    """A saved base model with its tokenizer, a fine-tuning corpus and a validation set, on disk in the
    formats the upstream stages write."""
    from moeflow.data.shards import write_split
    from moeflow.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("stage")
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=len(tokenizer), seed=1)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    rows = [{k: v for k, v in r.items()} for r in packed_rows(16)]
    for r in rows:
        r["input_ids"] = [min(t, len(tokenizer) - 1) for t in r["input_ids"]]
        r["labels"] = [t if t == -100 else min(t, len(tokenizer) - 1) for t in r["labels"]]
    write_split(root / "data" / "train", rows)
    write_split(root / "valset" / "heldout", rows[:4])
    write_json(
        root / "experts.json",
        choice_record(measure(typed(ModelSettings, fine_tune_model()), 2, 64, torch.device("cpu"), "fp32")),
    )
    return root


def run_stage_script(script, root, rule, inputs, outputs, params, torchrun=False):
    job = {
        "rule": rule,
        "input": {k: str(v) for k, v in inputs.items()},
        "output": {k: str(v) for k, v in outputs.items()},
        "params": params,
    }
    args = [str(SCRIPTS / script), "--job", json.dumps(job), "--threads", "1", "--log-file", str(root / f"{rule}.log")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "PYTHONSAFEPATH": "1"}
    env.pop(KILL_ENV, None)
    command = TORCHRUN + args if torchrun else [sys.executable] + args
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def fine_tune_settings(**train):
    """The warmup and train_model stages' settings (as their rules pass them) of a run with the tiny model."""
    section = {
        "steps": 4,
        "warmup_steps": 2,
        "lr": 1e-3,
        "min_lr": 1e-4,
        "micro_batch_size": 2,
        "grad_accum_steps": 2,
        "eval_every": 2,
        "checkpoint_every": 1,
        "routing_guard": {"window_steps": 2, "max_load_ratio": 3.9, "min_load_entropy": 0.2, "max_dead_experts": 2},
        **train,
    }
    cfg = run_config(load(overrides={"model": tiny_model_cfg(), "train": section}), "moe")
    return warmup_settings(cfg), train_model_settings(cfg)


def fine_tune_model() -> dict:
    """The model section of :func:`fine_tune_settings`' run (rule choose_experts's choice is made for it)."""
    return run_config(load(overrides={"model": tiny_model_cfg()}), "moe")["model"]


def test_warmup_and_train_model_stages_make_a_loadable_model(stage_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    warmup_settings, train_settings = fine_tune_settings()
    runtime = {"precision": "fp32", "seed": 3, "stack": "test"}
    warm = tmp_path / "warmup"
    done = run_stage_script(
        "warmup.py",
        tmp_path,
        "warmup",
        {"model": stage_inputs / "base", "data": stage_inputs / "data", "experts": stage_inputs / "experts.json"},
        {"checkpoint": warm},
        {
            "settings": warmup_settings,
            "runtime": runtime,
            "checkpoints": str(tmp_path / "ckpt"),
            "failed_report": str(tmp_path / "failed.json"),
        },
        torchrun=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((warm / "routing_report.json").read_text())["stable"]
    assert json.loads((warm / "trainer_state.json").read_text())["step"] == 2
    assert not any((tmp_path / "ckpt").iterdir())  # resumable checkpoints removed once the stage succeeded

    outputs = {"model": tmp_path / "final", "logs": tmp_path / "logs", "adapter": tmp_path / "adapter"}
    done = run_stage_script(
        "train_model.py",
        tmp_path,
        "train_model",
        {
            "model": stage_inputs / "base",
            "data": stage_inputs / "data",
            "warmup": warm,
            "valset": stage_inputs / "valset",
            "experts": stage_inputs / "experts.json",
        },
        outputs,
        {
            "settings": train_settings,
            "runtime": runtime,
            "checkpoints": str(tmp_path / "ckpt"),
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] == 4 and [e["step"] for e in summary["eval"]] == [2, 4]
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if '"train"' in x
    ]
    assert steps == [1, 2, 3, 4]  # the warmup's steps are part of the run's log
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert model.config.num_experts == 4 and len(tokenizer) == model.config.vocab_size
    assert json.loads((tmp_path / "adapter" / "trainable_parameters.json").read_text())["method"] == "full"


def test_warmup_with_an_unstable_router_fails_with_the_report(stage_inputs, tmp_path):
    warmup_settings, _ = fine_tune_settings(
        routing_guard={"window_steps": 2, "max_load_ratio": 1.01, "reference": "absolute"}
    )
    done = run_stage_script(
        "warmup.py",
        tmp_path,
        "warmup",
        {"model": stage_inputs / "base", "data": stage_inputs / "data", "experts": stage_inputs / "experts.json"},
        {"checkpoint": tmp_path / "warmup"},
        {
            "settings": warmup_settings,
            "runtime": {"precision": "fp32", "seed": 3, "stack": "test"},
            "checkpoints": str(tmp_path / "ckpt"),
            "failed_report": str(tmp_path / "failed.json"),
        },
    )
    assert done.returncode != 0
    assert "routing is unstable after 2 steps" in done.stderr and "busiest expert gets" in done.stderr
    assert not (tmp_path / "warmup").exists()
    report = json.loads((tmp_path / "failed.json").read_text())
    assert not report["stable"] and report["problems"]


# --------------------------------------------------------------------------- through Snakemake (smoke config)


def _final_model_target(workdir: Path, run: str = "moe") -> str:
    from conftest import active_stack

    return f"results/{active_stack()}/runs/{run}/model"


@pytest.mark.pipeline
@pytest.mark.fast
def test_a_second_part_setting_reruns_train_model_but_not_warmup(smoke_pipeline):
    from conftest import scheduled_rules, write_overlay

    target = _final_model_target(smoke_pipeline)
    for second_part in ({"steps": 10}, {"min_lr": 1e-6}, {"eval_every": 3}):
        rules = scheduled_rules(smoke_pipeline, write_overlay(smoke_pipeline, {"train": second_part}), target=target)
        assert "train_model" in rules and "warmup" not in rules, (second_part, rules)
    for first_part in ({"lr": 1e-4}, {"warmup_steps": 3}):
        rules = scheduled_rules(smoke_pipeline, write_overlay(smoke_pipeline, {"train": first_part}), target=target)
        assert {"warmup", "train_model"} <= rules and "pretrain_base" not in rules, (first_part, rules)
    (smoke_pipeline / "config" / "change.yaml").unlink()


@pytest.mark.pipeline
def test_killed_train_model_resumes_from_its_checkpoint_with_the_same_losses(pipeline_copy):
    from conftest import active_stack, executed_rules, snakemake

    # the smoke pipeline's uninterrupted train_model is the reference (the copy is up to date: no run needed)
    target = _final_model_target(pipeline_copy)
    metrics = pipeline_copy / "results" / active_stack() / "runs" / "moe" / "train" / "metrics.jsonl"
    reference = [json.loads(x) for x in metrics.read_text().splitlines()]
    # rerun train_model alone (--forcerun: a config change would rerun plan_memory too, a job of CI time) and
    # die with SIGKILL after step 6's checkpoint
    args = (target, "--cores", "2", "--configfile", "config/smoke.yaml")
    killed = snakemake(
        pipeline_copy, *args, "--forcerun", "train_model", check=False, env={KILL_ENV: "train_model.step6"}
    )
    assert killed.returncode != 0 and executed_rules(killed) == {"train_model"}
    checkpoints = list((pipeline_copy / "results" / active_stack() / "checkpoints").glob("train_model-*/step-00000006"))
    assert len(checkpoints) == 1
    assert executed_rules(snakemake(pipeline_copy, *args, "--rerun-incomplete")) == {"train_model"}
    log = (pipeline_copy / "results" / active_stack() / "logs" / "train_model" / "moe.log").read_text()
    assert "continuing from" in log and "step-00000006 at step 6" in log
    resumed = [json.loads(x) for x in metrics.read_text().splitlines()]
    train_losses = lambda records: [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]  # noqa: E731
    assert train_losses(resumed) == train_losses(reference) and len(train_losses(reference)) == 8
    assert not checkpoints[0].parent.exists()  # removed once the stage succeeded
