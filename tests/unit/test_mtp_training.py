"""MTP training (``train.mtp.mode: train``, moeflow.train.trainer with moeflow.model.mtp_loss): the step's gradient
against a full-logits hand computation of (main loss + w x mean MTP loss) / label tokens on the whole batch, for
any split into micro-batches; ``frozen`` leaves the MTP layers bit-identical; ``train`` moves them, resumes
exactly and exports them under the published names; the reports, the planner and the config check follow.
DeepSeek-V3 (1 and 2 MTP layers) on both stacks, Step-3.5-Flash (2 layers in its tiny model) on the current one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import SHARDED_LAYOUTS, run_ranks
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import TRANSFORMERS_5_ONLY, VOCAB, model_config, spread_routers

from moeflow.checkpoint import export
from moeflow.data.collate import collate, model_inputs
from moeflow.data.shards import IGNORE_INDEX
from moeflow.families.mtp import is_mtp_name, mtp_layers, mtp_prefixes, mtp_report
from moeflow.loading.factory import make_model
from moeflow.model.chunked_loss import decoder_forward
from moeflow.model.lora import trainable_parameter_report
from moeflow.model.mtp_loss import mtp_loss_sums
from moeflow.model.parameters import ROUTED_EXPERTS, counted_category
from moeflow.model.settings import ModelSettings
from moeflow.plan import memory as plan
from moeflow.plan.counts import count_parameters
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.metrics import flop_bearing_parameters
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import TrainConfigError, Trainer
from moeflow.workflow.keys import training

WEIGHT = 0.7
CASES = [("deepseek_v3", 1), ("deepseek_v3", 2), ("step3p5", 2)]
PARAMS = [pytest.param(*c, marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="transformers 5 only"))
          if c[0] in TRANSFORMERS_5_ONLY else c for c in CASES]  # fmt: skip


def build(family: str, depth: int, seed: int = 0):
    cfg = model_config(family)
    cfg["config"]["num_nextn_predict_layers"] = depth
    model = make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=seed).to(
        torch.float32
    )  # 4.57: float32 routing
    spread_routers(model, seed)
    assert len(mtp_layers(model)) == depth
    return model


# Rows of 24 tokens packing documents of these lengths; each document's first `masked` labels are ignored (a
# prompt), so the rows hold different label counts and a per-micro-batch normaliser differs from the step's.
ROWS = [((10, 14), 1), ((24,), 6), ((7, 9, 8), 1), ((12, 12), 4)]


def rows(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths, masked in ROWS:
        ids, labels, positions = [], [], []
        for n in lengths:
            doc = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            ids += doc
            labels += [IGNORE_INDEX] * masked + doc[masked:]
            positions += list(range(n))
        out.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return out


def settings(mode: str = "train", micro_batch_size: int = 2, grad_accum_steps: int = 2, **extra) -> TrainSettings:
    section = {
        "steps": 3,
        "lr": 1e-2,
        "warmup_steps": 1,
        "order": "sequential",
        "micro_batch_size": micro_batch_size,
        "grad_accum_steps": grad_accum_steps,
        "balance": {"mode": "off", "z_loss_coef": 0.0},
        "mtp": {"mode": mode, "loss_weight": WEIGHT},
        "routing_guard": {"window_steps": 100},
        "memory_guard": {"skip_steps": 100},
        **extra,
    }
    return typed(TrainSettings, training(section))


def hand_gradients(model, batch_rows: list[dict]) -> dict[str, torch.Tensor]:
    """The gradient of (sum of the main cross-entropy + w x mean over depths of each depth's summed MTP loss)
    / the batch's label tokens, on the whole batch in one pass; the main loss from the full logits."""
    model.zero_grad(set_to_none=True)
    batch = collate(batch_rows)
    inputs = model_inputs(model, batch)
    logits = model(**inputs, use_cache=False).logits  # the full logits
    labels = batch["labels"]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="sum")
    hidden = decoder_forward(model, inputs).last_hidden_state
    sums = mtp_loss_sums(model, hidden, batch, chunk_tokens=7)
    tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    ((main + WEIGHT * torch.stack(sums).mean()) / tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(("family", "depth"), PARAMS)
@pytest.mark.parametrize("split", [(4, 1), (2, 2)])  # micro_batch_size, grad_accum_steps: 4 rows a step
def test_the_step_gradient_is_main_plus_weighted_mean_mtp_loss_over_the_steps_label_tokens(family, depth, split):
    model = build(family, depth).train()
    trainer = Trainer(model, settings(micro_batch_size=split[0], grad_accum_steps=split[1]), rows(), collate_fn=collate,
                      seed=0)  # fmt: skip
    summary = trainer.step_gradients()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want = hand_gradients(model, rows())
    mtp = mtp_prefixes(model)
    assert any(n.startswith(mtp) for n in want) and sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert summary["mtp"] > 0


@pytest.mark.parametrize(("family", "depth"), PARAMS)
def test_the_mfu_counts_the_mtp_layers_only_when_they_train(family, depth):
    """Frozen MTP layers are not run: the FLOPs per token are the trunk's, as the planner counts them (from the
    config, without the MTP layers). Trained, each MTP layer adds its active parameters (routed experts at
    top_k / E)."""
    model = build(family, depth)
    frozen = Trainer(model, settings("frozen"), rows(), collate_fn=collate, seed=0).flops_per_token
    trained = Trainer(model, settings("train"), rows(), collate_fn=collate, seed=0).flops_per_token
    section = model_config(family)
    section["config"]["num_nextn_predict_layers"] = depth
    _, planned, _ = count_parameters(section, tokenizer_vocab=VOCAB)
    assert frozen == 6 * planned.flop_bearing == 6 * flop_bearing_parameters(model)
    prefixes, config = mtp_prefixes(model), model.config
    mtp = {n: p.numel() for n, p in model.named_parameters() if is_mtp_name(n, prefixes) and "embed_tokens" not in n}
    routed = sum(k for n, k in mtp.items() if counted_category(n) == ROUTED_EXPERTS)
    top_k = config.num_experts_per_tok / (getattr(config, "n_routed_experts", None) or config.moe_num_experts)
    assert trained - frozen == pytest.approx(6 * (sum(mtp.values()) - routed + routed * top_k), abs=6)


def test_the_step_gradient_is_the_same_under_activation_checkpointing():
    model = build("deepseek_v3", 1).train()
    trainer = Trainer(model, settings(gradient_checkpointing=True), rows(), collate_fn=collate, seed=0)
    trainer.step_gradients()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want = hand_gradients(model, rows())
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def mtp_state(model) -> dict[str, torch.Tensor]:
    prefixes = mtp_prefixes(model)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith(prefixes)}


@pytest.mark.parametrize(("family", "depth"), PARAMS)
def test_the_evaluation_reports_the_mtp_loss_of_the_validation_rows_when_the_mtp_layers_train(family, depth):
    """The in-training evaluation's ``mtp_loss``, defined as training's (each depth's summed cross-entropy, the
    mean over depths, per label token), equals a hand computation on the whole validation set in one batch;
    with the MTP layers frozen there is none."""
    model = build(family, depth)
    evaluation = Trainer(model, settings(), rows(), collate_fn=collate, seed=0, eval_rows=rows(1)).evaluate()
    model.eval()
    batch = collate(rows(1))
    with torch.no_grad():
        hidden = decoder_forward(model, model_inputs(model, batch)).last_hidden_state
        sums = mtp_loss_sums(model, hidden, batch, chunk_tokens=7)
    tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert evaluation["label_tokens"] == tokens
    assert evaluation["mtp_loss"] == pytest.approx(float(torch.stack(sums).mean()) / tokens, rel=1e-5)
    frozen = Trainer(model, settings("frozen"), rows(), collate_fn=collate, seed=0, eval_rows=rows(1)).evaluate()
    assert "mtp_loss" not in frozen and frozen["loss"] == pytest.approx(evaluation["loss"], rel=1e-12)


def test_mode_frozen_keeps_the_mtp_layers_bit_identical_and_out_of_the_loss():
    frozen = settings("frozen")
    assert frozen.mtp is None and settings().trained_mtp.loss_weight == WEIGHT
    assert typed(TrainSettings, {"steps": 1, "lr": 1e-3}).trained_mtp is None  # typed alone: the frozen default
    model = build("deepseek_v3", 1).train()
    before = mtp_state(model)
    trainer = Trainer(model, frozen, rows(), collate_fn=collate, seed=0)
    trainer.run()
    assert all(torch.equal(t, before[n]) for n, t in mtp_state(model).items())
    assert all("mtp_loss" not in r for r in trainer.train_records())
    in_groups = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in in_groups for _, layer in mtp_layers(model) for p in layer.parameters())
    assert not mtp_report(model)["trained"]


@pytest.mark.parametrize(("family", "depth"), [p for p in PARAMS if p != ("deepseek_v3", 2)])
def test_mode_train_moves_the_mtp_layers_resumes_exactly_and_exports_them(family, depth, tmp_path):
    model = build(family, depth).train()
    before = mtp_state(model)
    whole = Trainer(model, settings(), rows(), collate_fn=collate, seed=0)
    whole.run()
    trained = mtp_state(model)
    assert all(not torch.equal(trained[n], before[n]) for n in before if n.endswith("eh_proj.weight"))
    records = whole.train_records()
    assert all(r["mtp_loss"] > 0 for r in records)
    assert records[0]["loss"] == pytest.approx(records[0]["ce"] + WEIGHT * records[0]["mtp_loss"], rel=1e-12)
    report = mtp_report(model)
    assert report["trained"] and "trained with the MTP loss" in report["note"]
    counted = trainable_parameter_report(model)
    assert counted["trainable"] == counted["total"]

    first = Trainer(build(family, depth).train(), settings(), rows(), collate_fn=collate, seed=0)
    first.run(until=2)
    first.save(tmp_path / "ckpt")
    resumed_model = build(family, depth, seed=7).train()
    resumed = Trainer(resumed_model, settings(), rows(), collate_fn=collate, seed=0)
    resumed.load(tmp_path / "ckpt")
    resumed.run()
    keys = ("loss", "ce", "mtp_loss", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed.train_records()] == [[r[k] for k in keys] for r in records]
    again = mtp_state(resumed_model)
    assert all(torch.equal(again[n], trained[n]) for n in trained)

    export.save_final_model(model, None, tmp_path / "export", max_shard_size="5GB")
    written = {}
    for path in (tmp_path / "export").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            written |= {k: f.get_tensor(k) for k in f.keys() if k.startswith(mtp_prefixes(model))}
    own = [n for n in trained if n.split(".")[3] in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")]
    assert own and set(own) <= set(written)  # the published names: model.layers.<n + d>.{enorm, eh_proj, ...}
    assert all(torch.equal(written[n], trained[n]) for n in own)
    exported = mtp_state(make_model(typed(ModelSettings, model_config(family)), folder=tmp_path / "export"))
    assert sorted(exported) == sorted(trained) and all(torch.equal(exported[n], trained[n]) for n in trained)


def test_mode_train_on_a_model_without_mtp_layers_is_refused():
    model = make_model(typed(ModelSettings, model_config("qwen3_moe")), vocab_size=VOCAB)
    with pytest.raises(TrainConfigError, match=r"'train.mtp.mode': train, but the model \(qwen3_moe\) has no MTP"):
        Trainer(model, settings(), rows(), collate_fn=collate, seed=0)


def test_the_planner_counts_the_optimizer_state_of_trained_mtp_layers():
    """The planner's AdamW term (8 bytes per parameter holding state) equals the state the Trainer holds: the
    whole model's with mode train, all but the MTP layers' with mode frozen."""
    cfg = model_config("deepseek_v3")
    shape, params, _ = count_parameters({**cfg, "loss_chunk_tokens": 1024}, VOCAB)
    for mode in ("frozen", "train"):
        trainer = Trainer(build("deepseek_v3", 1), settings(mode, steps=1), rows(), collate_fn=collate, seed=0)
        trainer.run()
        held = sum(p.numel() for p in trainer.optimizer.state)
        job = plan.Job.from_settings(
            typed(
                plan.PlanMemoryStage,
                {
                    "precision": "fp32",
                    "seq_len": 24,
                    "vocab_size": 0,  # not read: the job's memory settings only
                    "model": {**cfg, "loss_chunk_tokens": 1024, "quantization": "none"},
                    "train": training({"steps": 1, "lr": 1e-3, "mtp": {"mode": mode}}),
                    "hardware": {"device": "cpu", "num_devices": 1},
                    "parallel": {"strategy": "none", "nproc_per_node": 1, "nnodes": 1, "fsdp_size": None, "ep_size": 1},
                },
            )
        )
        assert job.mtp_trained == (mode == "train")
        assert plan.resident_state(shape, params, job)["optimizer"] == held * plan.ADAM_MOMENT_BYTES, mode
        assert plan.memory_per_device(shape, params, job)["gradients"] == held * 4, mode


@pytest.mark.parametrize("parallel", SHARDED_LAYOUTS)
def test_mode_train_on_two_sharded_ranks_gives_one_processes_losses_and_update(tmp_path, parallel):
    """DeepSeek-V3 with 2 MTP layers, each its own FSDP unit (FSDP2 on the current stack, FSDP1 on the pinned one;
    under expert parallelism their experts split over the ranks too): each depth runs in one call of its layer, so
    its parameters are gathered and its gradients reduced. The losses (main and MTP) are one process's with both
    ranks' rows, and so is the update of every parameter, MTP layers included."""
    model = build("deepseek_v3", 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "model")
    results = run_ranks(_mtp_rank, str(tmp_path), parallel, timeout_s=300)
    one = Trainer(model.train(), settings(), rows(), collate_fn=collate, seed=0)  # both ranks' 2 rows a step
    one.run()
    keys = ("loss", "ce", "mtp_loss")
    torch.testing.assert_close(
        results["records"], [[r[k] for k in keys] for r in one.train_records()], rtol=1e-5, atol=0
    )
    sharded, reference = load_file(tmp_path / "trained.safetensors"), model.state_dict()
    assert sharded.keys() == reference.keys()
    moved = [n for n in mtp_state(model) if n.endswith(("eh_proj.weight", "enorm.weight", "shared_head.head.weight"))]
    assert len(moved) == 6 and all(not torch.equal(sharded[n], before[n]) for n in moved)
    off = []
    for name, want in reference.items():
        # AdamW's update is about lr x sign(g): compared as a whole per tensor (a lost gradient is off by all of it)
        update = float((want - before[name]).norm())
        if float((sharded[name] - want).norm()) > 1e-2 * update + 1e-6:
            off.append(name)
    assert off == [], off


def _mtp_rank(rank: int, root: str, parallel: dict, results: dict) -> None:
    from gloo_ranks import gloo_group, sharded_layout
    from safetensors.torch import save_file

    from moeflow.parallel.layouts import full_state_dict

    torch.set_num_threads(1)
    with gloo_group(rank, root) as ranks:
        layout = sharded_layout(ranks, parallel)
        cfg = model_config("deepseek_v3")
        cfg["config"]["num_nextn_predict_layers"] = 2
        model = make_model(typed(ModelSettings, cfg), folder=f"{root}/model", layout=layout)
        trainer = Trainer(model, settings(micro_batch_size=1), rows(), collate_fn=collate, seed=0)
        trainer.run()
        weights, _ = full_state_dict(trainer.model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, f"{root}/trained.safetensors")
            results["records"] = [[r[k] for k in ("loss", "ce", "mtp_loss")] for r in trainer.train_records()]


@pytest.mark.parametrize("parallel", SHARDED_LAYOUTS)
def test_mode_train_in_bf16_after_a_forward_trains_the_mtp_layers_on_two_sharded_ranks(tmp_path, parallel):
    """#36 item 1: warmup routes the base model (a forward) before its Trainer is built. FSDP2 fixes each unit's
    gradient dtypes at its first forward from the parameters that require grad then; MTP layers still frozen then
    got bf16 gradients for fp32 parameters and the first backward failed. The factory now unfreezes them as it
    builds a model for training: in bf16 on two ranks, after a forward, the first step completes and every MTP
    layer moves."""
    model = build("deepseek_v3", 2)
    model.save_pretrained(tmp_path / "model")
    results = run_ranks(_mtp_bf16_rank, str(tmp_path), parallel, timeout_s=300)
    assert results["steps"] == 2 and results["masters"] == ["torch.float32"]
    assert results["moved"] and all(results["moved"].values()), results["moved"]


def _mtp_bf16_rank(rank: int, root: str, parallel: dict, results: dict) -> None:
    from gloo_ranks import gloo_group, sharded_layout

    from moeflow.model.parameters import clean_name
    from moeflow.model.wrappers import unwrap
    from moeflow.parallel.layouts import full_state_dict

    torch.set_num_threads(1)
    with gloo_group(rank, root) as ranks:
        train = settings(micro_batch_size=1, steps=2)
        layout = dataclasses.replace(sharded_layout(ranks, parallel), train=train, precision="bf16")
        cfg = model_config("deepseek_v3")
        cfg["config"]["num_nextn_predict_layers"] = 2
        model = make_model(typed(ModelSettings, cfg), folder=f"{root}/model", layout=layout).train()
        before, _ = full_state_dict(model)
        batch = collate(rows()[rank : rank + 1])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # warmup's base reference
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        trainer = Trainer(model, train, rows(), collate_fn=collate, seed=0, precision="bf16")
        trainer.run()
        masters = sorted({str(p.dtype) for _, layer in mtp_layers(model) for p in layer.parameters()})
        after, _ = full_state_dict(trainer.model)
        prefixes = tuple(clean_name(prefix) for prefix in mtp_prefixes(unwrap(model)))  # without FSDP1's wrappers
        if rank == 0:
            results["steps"] = trainer.step
            results["masters"] = masters
            results["moved"] = {
                name: not torch.equal(after[name], before[name])
                for name in after
                if is_mtp_name(name, prefixes) and name.endswith(("eh_proj.weight", "enorm.weight"))
            }
