"""The training loop: schedule, parameter groups, exact resume, warmup + train = one run, guards, logs.

A tiny qwen3_moe on synthetic packed rows (the data stage's row format), a few steps each.
Run as a script (``python tests/test_train.py <dir> <steps>``) it trains in a fresh process: the
kill/resume test uses that with ``MOEFLOW_KILL_AT`` to die with SIGKILL at a chosen step.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tiny_models, tiny_training

from tiny_models import tiny_dense_cfg, tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, losses, make_trainer, packed_rows, run_training_script, settings  # noqa: E402

from moeflow.checkpoint.state import latest_checkpoint
from moeflow.data.collate import collate
from moeflow.data.order import DataOrder, DataOrderError
from moeflow.loading.factory import make_model
from moeflow.model.activation_checkpointing import enable_activation_checkpointing
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.settings import ConfigError, typed
from moeflow.train.param_groups import lr_factor, param_groups
from moeflow.train.settings import BalanceSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import warmup_key, warmup_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import deep_merge

RUNTIME = {"stack": "pinned", "precision": "fp32", "seed": 7}

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
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=0)
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
    with pytest.raises(ConfigError, match="no optimizer 'adamw_moe'; use train.optimizer: adamw"):
        load(overrides={"train": {"optimizer": "adamw_moe"}})
    with pytest.raises(ConfigError, match="'DataCollatorForMoE'"):
        load(overrides={"train": {"data_collator": "DataCollatorForMoE"}})
    with pytest.raises(ConfigError, match="'Trainer.accumulate_gradient' does not exist; set train.grad_accum_steps"):
        load(overrides={"train": {"accumulate_gradient": True}})
    with pytest.raises(ConfigError, match="'train.warmup_steps' and 'train.warmup_ratio' are both set"):
        load(overrides={"train": {"warmup_steps": 1000, "warmup_ratio": 0.1}})


def test_warmup_key_ignores_settings_of_the_second_part_only():
    cfg = run_config(load(), "moe")
    key = warmup_key(cfg)
    for second_part in ({"steps": 500}, {"min_lr": 0.0}, {"eval_every": 3}):
        assert warmup_key(deep_merge(cfg, {"train": second_part})) == key
    for first_part in ({"lr": 2 * cfg["train"]["lr"]}, {"warmup_steps": 3}, {"balance": {"mode": "exact"}}):
        assert warmup_key(deep_merge(cfg, {"train": first_part})) != key
    assert warmup_key(deep_merge(cfg, {"data": {"seq_len": 256}})) != key
    ratio = deep_merge(cfg, {"train": {"warmup_steps": None, "warmup_ratio": 0.2, "steps": 40}})
    assert warmup_settings(ratio)["train"]["warmup_steps"] == 8


def test_job_from_argv_reads_what_the_rule_passes():
    params = {"settings": {"strategy": "fsdp", "nproc_per_node": 2}, "runtime": RUNTIME}
    argv = ["--threads", "2", "--log-file", "l.log", "--job"]
    argv.append(
        json.dumps({"rule": "warmup", "input": {"model": "m"}, "output": {"checkpoint": "c"}, "params": params})
    )
    job = Job.from_argv(ParallelSettings, argv)
    assert (job.rule, job.input.model, job.output.checkpoint, job.params.runtime, job.threads, job.log_file) == (
        "warmup",
        "m",
        "c",
        RUNTIME,
        2,
        "l.log",
    )
    assert job.settings == typed(ParallelSettings, params["settings"]) and job.settings.ep_size == 1  # the schema's
    assert Job.from_argv(argv=argv).settings is None


def test_a_stage_starts_the_same_from_a_snakemake_object_and_from_a_job():
    from snakemake.iocontainers import Namedlist

    smk = SimpleNamespace(
        rule="evaluate_run",
        input=Namedlist(fromdict={"model": "m"}),
        output=Namedlist(fromdict={"json": "o.json"}),
        params=Namedlist(fromdict={"runtime": RUNTIME}),
        threads=1,
        log=Namedlist(),
    )
    job = Job.from_snakemake(smk)
    assert (job.rule, job.input.model, job.output.json, job.threads, job.log_file) == (
        "evaluate_run",
        "m",
        "o.json",
        1,
        None,
    )
    for source in (smk, job):
        stage = Stage.start(source)
        assert (stage.name, stage.threads, stage.precision, stage.seed, stage.stack) == (
            "evaluate_run",
            1,
            "fp32",
            7,
            "pinned",
        )


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


def test_kill_minus_nine_then_resume_gives_the_same_final_loss(tmp_path):
    killed = run_training_script(__file__, tmp_path / "resumed", 6, kill_at="train.step5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step-00000004"
    resumed = run_training_script(__file__, tmp_path / "resumed", 6)
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stderr and "at step 4" in resumed.stderr
    straight = run_training_script(__file__, tmp_path / "straight", 6)
    assert straight.returncode == 0, straight.stderr
    result = [json.loads(line) for line in (tmp_path / "resumed" / "logs" / "metrics.jsonl").read_text().splitlines()]
    reference = [
        json.loads(line) for line in (tmp_path / "straight" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], r["loss"]) for r in result] == [(r["step"], r["loss"]) for r in reference]
    assert len(result) == 6


def test_gradient_checkpointing_gives_the_same_gradients():
    """Non-reentrant checkpointing reruns the routers in backward: the hooks must not count them twice."""
    from moeflow.model.routing import adapter_or_none
    from moeflow.train.trainer import accumulate_gradients

    rows = packed_rows(4)
    batches = [collate(rows[i : i + 2]) for i in (0, 2)]
    results = []
    for checkpointing in (False, True):
        model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=0).double()
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model)
        step = accumulate_gradients(
            model,
            batches,
            typed(BalanceSettings, {"mode": "exact", "coef": 0.1}),
            adapter_or_none(model),
        )
        results.append(
            (
                torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]),
                step.summary()["counts"],
            )
        )
    (plain, plain_counts), (recomputed, recomputed_counts) = results
    assert plain_counts == recomputed_counts
    assert float((plain - recomputed).norm() / plain.norm()) < 1e-10


def test_dense_model_trains_without_routing():
    model = make_model(typed(ModelSettings, tiny_dense_cfg()), vocab_size=VOCAB, seed=0)
    trainer = Trainer(model, settings(steps=2, warmup_steps=1), packed_rows(), collate_fn=collate, seed=0)
    trainer.run()
    assert trainer.adapter is None and trainer.train_records()[-1]["balance_loss"] == 0.0
    assert trainer.routing_guard.report()["stable"]


def test_loss_free_balancing_moves_the_deepseek_correction_bias():
    cfg = {
        "attn_implementation": "eager",
        "experts_implementation": STACK_DEFAULT_EXPERTS,
        "config": {
            "model_type": "deepseek_v3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "max_position_embeddings": 64,
        },
    }
    model = make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=0)
    rate = 0.01
    s = settings(steps=3, warmup_steps=1, balance={"mode": "off", "bias_update_rate": rate})
    trainer = Trainer(model, s, packed_rows(), collate_fn=collate, seed=0)
    trainer.run()
    (bias,) = trainer.biases
    counts = torch.tensor([r["routing"][0]["load"] for r in trainer.train_records()], dtype=torch.float64)
    expected = (rate * torch.sign(counts.mean(-1, keepdim=True) - counts)).sum(0)
    assert torch.allclose(bias.double(), expected, atol=1e-6) and bias.abs().sum() > 0


def test_sequential_order_takes_the_rows_as_stored_every_epoch_and_resumes_only_in_that_order():
    """train.order: sequential (StepFun's recipe): the rows in their stored order each epoch, where shuffled
    permutes them; the trainer takes its micro-batches in that order, and a checkpoint's position does not load
    into the other order."""
    sequential, shuffled = DataOrder(5, seed=3, order="sequential"), DataOrder(5, seed=3)
    assert sequential.take(7) == [0, 1, 2, 3, 4, 0, 1]
    assert sorted(shuffled.take(5)) == [0, 1, 2, 3, 4] and shuffled.state_dict()["order"] == "shuffled"
    assert DataOrder(5, seed=3).take(5) != [0, 1, 2, 3, 4]  # this seed does permute
    with pytest.raises(DataOrderError, match="sequential order"):
        DataOrder(5, seed=3).load_state_dict(sequential.state_dict())
    rows = packed_rows()
    trainer = make_trainer(train_settings=settings(order="sequential", grad_accum_steps=1))
    taken = [b["input_ids"] for b in trainer.micro_batches() + trainer.micro_batches()]
    want = [collate(rows[i : i + 2])["input_ids"] for i in (0, 2)]
    assert all(torch.equal(got, exp) for got, exp in zip(taken, want, strict=True))


# --------------------------------------------------------------------------- logs


def test_tensorboard_event_files_hold_scalars_and_expert_load_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(log_dir=tmp_path, train_settings=settings(steps=3, warmup_steps=1))
    trainer.run()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    for tag in (
        "train/loss",
        "train/ce",
        "train/balance_loss",
        "train/z_loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/memory_mib",
        "routing/layer0/load_entropy",
        "routing/layer1/router_entropy",
    ):
        assert tag in tags["scalars"], tag
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in trainer.train_records()]
    )
    histogram = events.Histograms("routing/layer0/expert_load")[0].histogram_value
    assert histogram.bucket == trainer.train_records()[0]["routing"][0]["load"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


def _main(folder: str, steps: str) -> None:
    """Train in this process (used by the kill/resume test), one thread like the test session."""
    torch.set_num_threads(1)
    folder = Path(folder)
    trainer = make_trainer(
        log_dir=folder / "logs",
        checkpoint_dir=folder / "checkpoints",
        stage="train",
        train_settings=settings(steps=int(steps), checkpoint_every=2),
    )
    trainer.resume()
    trainer.run()


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO)
    _main(*sys.argv[1:3])


def test_lora_fine_tuning_trains_adapters_only_and_resumes_exactly(tmp_path):
    from moeflow.loading.factory import Layout

    def lora_trainer():
        model = make_model(
            typed(ModelSettings, tiny_model_cfg()),
            vocab_size=VOCAB,
            seed=0,
            layout=Layout.single("cpu", settings(method="lora", lora={"rank": 2, "targets": ["attention"]})),
        )
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
