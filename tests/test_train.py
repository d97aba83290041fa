"""The training loop: schedule, parameter groups, exact resume, warmup + train = one run, guards, logs.

A tiny qwen3_moe on synthetic packed rows (the data stage's row format), a few steps each.
Run as a script (``python tests/test_train.py <dir> <steps>``) it trains in a fresh process: the
kill/resume test uses that with ``MOEFLOW_KILL_AT`` to die with SIGKILL at a chosen step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeflow import config as mfconfig
from moeflow import guards as G
from moeflow.collate import collate
from moeflow.modeling import build_model
from moeflow.stage import KILL_ENV
from moeflow.checkpoint import latest_checkpoint
from moeflow.optim import lr_factor, param_groups
from moeflow.stage import job_from_argv
from moeflow.train import Trainer
from test_losses import tiny_model_cfg  # noqa: E402

VOCAB = 97
SEQ = 32


def packed_rows(n=24, seed=0):
    """Rows in the data stage's format: several documents per row, positions restart, -100 at starts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(n):
        cut = int(torch.randint(5, SEQ - 5, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
        labels = list(ids)
        labels[0] = labels[cut] = -100
        rows.append({
            "input_ids": ids,
            "labels": labels,
            "position_ids": list(range(cut)) + list(range(SEQ - cut)),
            "doc_ids": [2 * r] * cut + [2 * r + 1] * (SEQ - cut),
        })
    return rows


def settings(**overrides):
    base = {
        "steps": 6, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "micro_batch_size": 2, "grad_accum_steps": 2,
        "balance": {"mode": "running", "coef": 0.01, "z_loss_coef": 0.001},
        "routing_guard": {"window_steps": 2, "max_load_ratio": 3.9, "min_load_entropy": 0.1, "max_dead_experts": 4},
        "memory_guard": {"skip_steps": 100},
    }
    return mfconfig.settings(mfconfig.TrainSettings, mfconfig.training({**base, **overrides}))


def make_trainer(tmp=None, seed=0, **kwargs):
    model = build_model(tiny_model_cfg(), VOCAB, seed=seed)
    s = kwargs.pop("train_settings", None) or settings()
    return Trainer(model, s, packed_rows(), collate_fn=collate, seed=seed, **kwargs)


def losses(trainer):
    return [(r["step"], r["loss"], r["ce"], r["grad_norm"]) for r in trainer.train_records()]


# --------------------------------------------------------------------------- settings


def test_schedule_warms_up_linearly_then_decays_to_min_lr():
    factors = [lr_factor(s, 4, 12, 0.1) for s in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] > 0.1
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert lr_factor(12, 4, 12, 0.1) == pytest.approx(0.1)
    # the warmup part does not depend on the total: changing train.steps keeps the warmup stage
    assert [lr_factor(s, 4, 100, 0.1) for s in range(4)] == factors[:4]


def test_param_groups_skip_decay_on_norms_and_scale_routers():
    model = build_model(tiny_model_cfg(), VOCAB, seed=0)
    groups = {g["name"]: g for g in param_groups(model, settings(router_lr_multiplier=0.5, weight_decay=0.1))}
    assert groups["router"]["lr_multiplier"] == 0.5 and groups["router"]["weight_decay"] == 0.1
    assert groups["other_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in groups["other_no_decay"]["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("mlp.gate.weight") for p in groups["router"]["params"])
    frozen = {g["name"] for g in param_groups(model, settings(freeze_router=True))}
    assert "router" not in frozen
    assert not model.model.layers[0].mlp.gate.weight.requires_grad


def test_copied_recipe_settings_are_refused_with_what_to_use():
    with pytest.raises(mfconfig.ConfigError, match="no optimizer 'adamw_moe'; use train.optimizer: adamw"):
        mfconfig.load(overrides={"train": {"optimizer": "adamw_moe"}})
    with pytest.raises(mfconfig.ConfigError, match="'DataCollatorForMoE'"):
        mfconfig.load(overrides={"train": {"data_collator": "DataCollatorForMoE"}})
    with pytest.raises(mfconfig.ConfigError, match="'Trainer.accumulate_gradient' does not exist; set train.grad_accum_steps"):
        mfconfig.load(overrides={"train": {"accumulate_gradient": True}})
    with pytest.raises(mfconfig.ConfigError, match="'train.warmup_steps' and 'train.warmup_ratio' are both set"):
        mfconfig.load(overrides={"train": {"warmup_steps": 1000, "warmup_ratio": 0.1}})


def test_warmup_key_ignores_settings_of_the_second_part_only():
    cfg = mfconfig.run_config(mfconfig.load(), "moe")
    key = mfconfig.warmup_key(cfg)
    for second_part in ({"steps": 500}, {"min_lr": 0.0}, {"eval_every": 3}):
        assert mfconfig.warmup_key(mfconfig.deep_merge(cfg, {"train": second_part})) == key
    for first_part in ({"lr": 1e-3}, {"warmup_steps": 3}, {"balance": {"mode": "exact"}}):
        assert mfconfig.warmup_key(mfconfig.deep_merge(cfg, {"train": first_part})) != key
    assert mfconfig.warmup_key(mfconfig.deep_merge(cfg, {"data": {"seq_len": 256}})) != key
    ratio = mfconfig.deep_merge(cfg, {"train": {"warmup_steps": None, "warmup_ratio": 0.2, "steps": 40}})
    assert mfconfig.warmup_settings(ratio)["train"]["warmup_steps"] == 8


def test_job_from_argv_reads_what_the_rule_passes():
    job = job_from_argv(["--job", json.dumps({"rule": "warmup", "input": {"model": "m", "lib": ["a.py"]}, "output": {"checkpoint": "c"},
                                              "params": {"settings": {"x": 1}}}), "--threads", "2", "--log-file", "l.log"])
    assert (job.rule, job.input.model, job.output.checkpoint, job.params.settings, job.threads, job.log) == ("warmup", "m", "c", {"x": 1}, 2, ["l.log"])


# --------------------------------------------------------------------------- exactness


def test_warmup_then_train_equals_one_uninterrupted_run(tmp_path):
    whole = make_trainer()
    whole.run()
    first = make_trainer()
    first.run(until=2)
    first.save(tmp_path / "warmup")
    second = make_trainer(seed=0)
    second.load(tmp_path / "warmup")
    second.run()
    assert losses(second) == losses(whole)  # bit for bit: same floats
    assert len(losses(whole)) == 6


def _train_in_subprocess(folder: Path, steps: int, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(KILL_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(mfconfig.REPO_ROOT / "src"), env.get("PYTHONPATH", "")])
    if kill_at:
        env[KILL_ENV] = kill_at
    return subprocess.run([sys.executable, __file__, str(folder), str(steps)], env=env, capture_output=True, text=True, timeout=300)


def test_kill_minus_nine_then_resume_gives_the_same_final_loss(tmp_path):
    killed = _train_in_subprocess(tmp_path / "resumed", 6, kill_at="train.step5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step-00000004"
    resumed = _train_in_subprocess(tmp_path / "resumed", 6)
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stderr and "at step 4" in resumed.stderr
    straight = _train_in_subprocess(tmp_path / "straight", 6)
    assert straight.returncode == 0, straight.stderr
    result = [json.loads(line) for line in (tmp_path / "resumed" / "logs" / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (tmp_path / "straight" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in result] == [(r["step"], r["loss"]) for r in reference]
    assert len(result) == 6


def test_gradient_checkpointing_gives_the_same_gradients():
    """Non-reentrant checkpointing reruns the routers in backward: the hooks must not count them twice."""
    from moeflow.routing import adapter_or_none
    from moeflow.train import accumulate_gradients, enable_checkpointing

    rows = packed_rows(4)
    batches = [collate(rows[i : i + 2]) for i in (0, 2)]
    results = []
    for checkpointing in (False, True):
        model = build_model(tiny_model_cfg(), VOCAB, seed=0).double()
        model.train()
        if checkpointing:
            enable_checkpointing(model)
        step = accumulate_gradients(model, batches, mfconfig.settings(mfconfig.BalanceSettings, {"mode": "exact", "coef": 0.1}), adapter_or_none(model))
        results.append((torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]), step.summary()["counts"]))
    (plain, plain_counts), (recomputed, recomputed_counts) = results
    assert plain_counts == recomputed_counts
    assert float((plain - recomputed).norm() / plain.norm()) < 1e-10


def test_dense_model_trains_without_routing():
    model = build_model(tiny_model_cfg(num_experts=0, intermediate_size=32), VOCAB, seed=0)
    trainer = Trainer(model, settings(steps=2, warmup_steps=1), packed_rows(), collate_fn=collate, seed=0)
    trainer.run()
    assert trainer.adapter is None and trainer.train_records()[-1]["balance_loss"] == 0.0
    assert trainer.routing_guard.report()["stable"]


def test_loss_free_balancing_moves_the_deepseek_correction_bias():
    cfg = {"attn_implementation": "eager", "config": {
        "model_type": "deepseek_v3", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
        "max_position_embeddings": 64}}
    model = build_model(cfg, VOCAB, seed=0)
    rate = 0.01
    s = settings(steps=3, warmup_steps=1, balance={"mode": "off", "bias_update_rate": rate})
    trainer = Trainer(model, s, packed_rows(), collate_fn=collate, seed=0)
    trainer.run()
    (bias,) = trainer.biases
    counts = torch.tensor([r["routing"][0]["load"] for r in trainer.train_records()], dtype=torch.float64)
    expected = (rate * torch.sign(counts.mean(-1, keepdim=True) - counts)).sum(0)
    assert torch.allclose(bias.double(), expected, atol=1e-6) and bias.abs().sum() > 0


# --------------------------------------------------------------------------- guards


def test_memory_guard_stops_a_leaking_step():
    leaked = []

    def leak(step, model):
        leaked.append(torch.ones(6 * 2**20 // 4).add_(step))  # 6 MiB kept alive per step

    trainer = make_trainer(step_hook=leak, train_settings=settings(
        steps=20, memory_guard={"skip_steps": 1, "window_steps": 4, "max_slope_mib_per_step": 2.0, "patience": 3}))
    with pytest.raises(G.MemoryLeak) as err:
        trainer.run()
    report = err.value.report
    assert report["slope_mib_per_step"] > 4 and report["last_step"] - report["first_step"] == 3
    assert report["last_step"] < 20 and "MiB/step over steps" in str(err.value)


def test_memory_guard_is_quiet_on_flat_memory(caplog):
    guard = G.MemoryGuard(mfconfig.MemoryThresholds(skip_steps=2, window_steps=4, max_slope_mib_per_step=1, patience=2))
    with caplog.at_level("WARNING", logger="moeflow.guards"):
        rates = [guard.observe(step, 1000.0 + (step % 2) * 0.5) for step in range(20)]
    # skipped steps and a filling window report nothing; from then on every step reports a small slope
    assert rates[:5] == [None] * 5 and all(r is not None and abs(r) <= 0.5 for r in rates[5:])
    assert guard.over == 0 and [s for s, _ in guard.samples] == [16, 17, 18, 19]
    assert not caplog.records


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    def poison(step, model):
        if step == 3:
            with torch.no_grad():
                model.model.embed_tokens.weight[:, 0] = float("nan")

    trainer = make_trainer(step_hook=poison, checkpoint_dir=tmp_path, train_settings=settings(checkpoint_every=2))
    with pytest.raises(G.NonFiniteLoss, match="step 4: non-finite"):
        trainer.run()
    assert latest_checkpoint(tmp_path).name == "step-00000002"


def test_routing_guard_flags_collapse_and_dead_experts():
    guard = G.RoutingGuard(mfconfig.settings(mfconfig.RoutingThresholds, {"window_steps": 2, "max_load_ratio": 2.0, "min_load_entropy": 0.5, "max_dead_experts": 0}))
    guard.observe(1, [[10, 10, 10, 10], [40, 0, 0, 0]], [1.3, 0.1], 5.0)
    alarms = guard.observe(2, [[9, 11, 10, 10], [40, 0, 0, 0]], [1.3, 0.1], 4.9)
    assert len(alarms) == 1 and "MoE layer 1" in alarms[0] and "dead experts [1, 2, 3]" in alarms[0]
    report = guard.report()
    assert not report["stable"] and report["layers"][1]["max_over_mean"] == 4.0
    assert report["layers"][0]["load_entropy"] > 0.99


def test_routing_guard_warns_when_loss_falls_fast_while_entropy_collapses():
    guard = G.RoutingGuard(mfconfig.settings(mfconfig.RoutingThresholds, {"window_steps": 50, "early_steps": 10}))
    guard.observe(1, [[5, 5]], [0.69], 8.0)
    messages = guard.observe(2, [[5, 5]], [0.1], 2.0)
    assert any("routing may have failed" in m for m in messages)


# --------------------------------------------------------------------------- logs


def test_tensorboard_event_files_hold_scalars_and_expert_load_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(log_dir=tmp_path, train_settings=settings(steps=3, warmup_steps=1))
    trainer.run()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    for tag in ("train/loss", "train/ce", "train/balance_loss", "train/z_loss", "train/lr", "train/grad_norm",
                "train/tokens_per_s", "train/memory_mib", "routing/layer0/load_entropy", "routing/layer1/router_entropy"):
        assert tag in tags["scalars"], tag
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in trainer.train_records()])
    histogram = events.Histograms("routing/layer0/expert_load")[0].histogram_value
    assert histogram.bucket == trainer.train_records()[0]["routing"][0]["load"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


def _main(folder: str, steps: str) -> None:
    """Train in this process (used by the kill/resume test), one thread like the test session."""
    torch.set_num_threads(1)
    folder = Path(folder)
    trainer = make_trainer(log_dir=folder / "logs", checkpoint_dir=folder / "checkpoints", stage="train",
                           train_settings=settings(steps=int(steps), checkpoint_every=2))
    trainer.resume()
    trainer.run()


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO)
    _main(*sys.argv[1:3])


# --------------------------------------------------------------------------- the stage scripts


SCRIPTS = mfconfig.REPO_ROOT / "workflow" / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "0.5", "--nproc_per_node", "1"]


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    """A saved base model with its tokenizer, a fine-tuning corpus and a validation set, on disk in the
    formats the upstream stages write."""
    from moeflow.shards import write_split
    from moeflow.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("stage")
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    model = build_model(tiny_model_cfg(), len(tokenizer), seed=1)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    rows = [{k: v for k, v in r.items()} for r in packed_rows(16)]
    for r in rows:
        r["input_ids"] = [min(t, len(tokenizer) - 1) for t in r["input_ids"]]
        r["labels"] = [t if t == -100 else min(t, len(tokenizer) - 1) for t in r["labels"]]
    write_split(root / "data" / "train", rows)
    write_split(root / "valset" / "heldout", rows[:4])
    return root


def run_stage_script(script, root, rule, inputs, outputs, params, torchrun=False):
    job = {"rule": rule, "input": {k: str(v) for k, v in inputs.items()}, "output": {k: str(v) for k, v in outputs.items()}, "params": params}
    args = [str(SCRIPTS / script), "--job", json.dumps(job), "--threads", "1", "--log-file", str(root / f"{rule}.log")]
    env = {**os.environ, "PYTHONPATH": str(mfconfig.REPO_ROOT / "src"), "PYTHONSAFEPATH": "1"}
    env.pop(KILL_ENV, None)
    command = TORCHRUN + args if torchrun else [sys.executable] + args
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def fine_tune_settings(**train):
    """The warmup and train_model stages' settings (as their rules pass them) of a run with the tiny model."""
    section = {
        "steps": 4, "warmup_steps": 2, "lr": 1e-3, "min_lr": 1e-4, "micro_batch_size": 2, "grad_accum_steps": 2,
        "eval_every": 2, "checkpoint_every": 1, "routing_guard": {"window_steps": 2, "max_load_ratio": 3.9, "min_load_entropy": 0.2, "max_dead_experts": 2},
        **train,
    }
    cfg = mfconfig.run_config(mfconfig.load(overrides={"model": tiny_model_cfg(), "train": section}), "moe")
    return mfconfig.warmup_settings(cfg), mfconfig.train_model_settings(cfg)


def test_warmup_and_train_model_stages_make_a_loadable_model(stage_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    warmup_settings, train_settings = fine_tune_settings()
    runtime = {"precision": "fp32", "seed": 3, "stack": "test"}
    warm = tmp_path / "warmup"
    done = run_stage_script("warmup.py", tmp_path, "warmup", {"model": stage_inputs / "base", "data": stage_inputs / "data"}, {"checkpoint": warm},
                            {"settings": warmup_settings,
                             "runtime": runtime, "checkpoints": str(tmp_path / "ckpt"), "failed_report": str(tmp_path / "failed.json")}, torchrun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((warm / "routing_report.json").read_text())["stable"]
    assert json.loads((warm / "trainer_state.json").read_text())["step"] == 2
    assert not any((tmp_path / "ckpt").iterdir())  # resumable checkpoints removed once the stage succeeded

    outputs = {"model": tmp_path / "final", "logs": tmp_path / "logs", "adapter": tmp_path / "adapter"}
    done = run_stage_script("train_model.py", tmp_path, "train_model",
                            {"model": stage_inputs / "base", "data": stage_inputs / "data", "warmup": warm, "valset": stage_inputs / "valset"}, outputs,
                            {"settings": train_settings, "runtime": runtime, "checkpoints": str(tmp_path / "ckpt")})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] == 4 and [e["step"] for e in summary["eval"]] == [2, 4]
    steps = [json.loads(x)["step"] for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert steps == [1, 2, 3, 4]  # the warmup's steps are part of the run's log
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert model.config.num_experts == 4 and len(tokenizer) == model.config.vocab_size
    assert json.loads((tmp_path / "adapter" / "trainable_parameters.json").read_text())["method"] == "full"


def test_warmup_with_an_unstable_router_fails_with_the_report(stage_inputs, tmp_path):
    warmup_settings, _ = fine_tune_settings(routing_guard={"window_steps": 2, "max_load_ratio": 1.01})
    done = run_stage_script("warmup.py", tmp_path, "warmup", {"model": stage_inputs / "base", "data": stage_inputs / "data"}, {"checkpoint": tmp_path / "warmup"},
                            {"settings": warmup_settings, "runtime": {"precision": "fp32", "seed": 3, "stack": "test"},
                             "checkpoints": str(tmp_path / "ckpt"), "failed_report": str(tmp_path / "failed.json")})
    assert done.returncode != 0
    assert "routing is unstable after 2 steps" in done.stderr and "busiest expert gets" in done.stderr
    assert not (tmp_path / "warmup").exists()
    report = json.loads((tmp_path / "failed.json").read_text())
    assert not report["stable"] and report["problems"]


def test_lora_fine_tuning_trains_adapters_only_and_resumes_exactly(tmp_path):
    from moeflow.lora import prepare_model

    def lora_trainer():
        model = prepare_model(build_model(tiny_model_cfg(), VOCAB, seed=0), settings(method="lora", lora={"rank": 2, "targets": ["attention"]}))
        return Trainer(model, settings(steps=3, warmup_steps=1), packed_rows(), collate_fn=collate, seed=0)

    whole = lora_trainer()
    before = {n: p.detach().clone() for n, p in whole.model.named_parameters() if not p.requires_grad}
    whole.run()
    assert all(torch.equal(p, before[n]) for n, p in whole.model.named_parameters() if not p.requires_grad)
    first = lora_trainer()
    first.run(until=1)
    first.save(tmp_path / "warmup")
    second = lora_trainer()
    second.load(tmp_path / "warmup")
    second.run()
    assert losses(second) == losses(whole)


# --------------------------------------------------------------------------- through Snakemake (smoke config)


def _final_model_target(workdir: Path, run: str = "moe") -> str:
    from conftest import active_stack

    return f"results/{active_stack()}/runs/{run}/model"


@pytest.mark.pipeline
def test_a_second_part_setting_reruns_train_model_but_not_warmup(smoke_pipeline):
    from test_pipeline import scheduled_rules, write_overlay

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
    from conftest import active_stack, snakemake

    target = _final_model_target(pipeline_copy)
    snakemake(pipeline_copy, target, "--cores", "2", "--configfile", "config/smoke.yaml")
    metrics = pipeline_copy / "results" / active_stack() / "runs" / "moe" / "train" / "metrics.jsonl"
    reference = [json.loads(x) for x in metrics.read_text().splitlines()]
    # rerun train_model (a second-part change) and die with SIGKILL after step 6's checkpoint
    overlay = pipeline_copy / "config" / "change.yaml"
    overlay.write_text("train: {eval_every: 2}\n")
    args = (target, "--cores", "2", "--configfile", "config/smoke.yaml", "config/change.yaml")
    killed = snakemake(pipeline_copy, *args, check=False, env={KILL_ENV: "train_model.step6"})
    assert killed.returncode != 0
    checkpoints = list((pipeline_copy / "results" / active_stack() / "checkpoints").glob("train_model-*/step-00000006"))
    assert len(checkpoints) == 1
    snakemake(pipeline_copy, *args, "--rerun-incomplete")
    log = (pipeline_copy / "results" / active_stack() / "logs" / "train_model" / "moe.log").read_text()
    assert "continuing from" in log and "step-00000006 at step 6" in log
    resumed = [json.loads(x) for x in metrics.read_text().splitlines()]
    train_losses = lambda records: [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]  # noqa: E731
    assert train_losses(resumed) == train_losses(reference)
    assert not checkpoints[0].parent.exists()  # removed once the stage succeeded
