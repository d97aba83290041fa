"""train.optimizer: muon (moeflow.train.optimizers): torch.optim.Muon on each hidden matrix (each expert's slice
of a fused tensor on its own), torch.optim.AdamW on the rest; its state through a checkpoint and resume; its size
in the memory planner; its refusal where it is not implemented."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, losses, make_trainer, packed_rows, settings  # noqa: E402

from moeflow.data.collate import collate  # noqa: E402
from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model.settings import ModelSettings  # noqa: E402
from moeflow.parallel import dtensors  # noqa: E402
from moeflow.plan.counts import count_parameters  # noqa: E402
from moeflow.plan.memory import Job, memory_per_device, resident_state  # noqa: E402
from moeflow.runtime import compat  # noqa: E402
from moeflow.settings import typed  # noqa: E402
from moeflow.train.param_groups import set_learning_rate  # noqa: E402
from moeflow.train.settings import LoraSettings, TrainSettings  # noqa: E402
from moeflow.train.trainer import Trainer  # noqa: E402
from moeflow.workflow.checks import optimizer_problems  # noqa: E402

needs_muon = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+ (the current stack); refused here"
)

# Qwen3-MoE's hidden matrices, written out here rather than taken from moeflow's rule: the attention projections and
# the experts' matrices (transformers 5: one fused [E, out, in] tensor per kind; 4.57: one Linear per expert)
MUON_NAMES = re.compile(
    r"self_attn\.[qkvo]_proj\.weight$|mlp\.experts\.(gate_up_proj|down_proj|\d+\.\w+_proj\.weight)$"
)
ROUTER_LR = 0.5


def _model(seed: int = 0, **config) -> torch.nn.Module:
    return make_model(typed(ModelSettings, tiny_model_cfg(**config)), vocab_size=VOCAB, seed=seed)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(start, grads, s, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` steps with the same gradients: torch.optim.Muon on each matrix (each expert's slice on its own),
    torch.optim.AdamW on the rest (no weight decay on 1-D tensors, the routers at ROUTER_LR x lr)."""
    muon = dict(lr=s.lr, weight_decay=s.weight_decay, momentum=s.muon.momentum, nesterov=s.muon.nesterov)
    muon |= dict(ns_steps=s.muon.ns_steps, adjust_lr_fn=s.muon.adjust_lr)
    out = {}
    for name, weight in start.items():
        fused = weight.dim() == 3 and MUON_NAMES.search(name)
        pairs = list(zip(weight.unbind(0), grads[name].unbind(0))) if fused else [(weight, grads[name])]
        params = [torch.nn.Parameter(w.clone()) for w, _ in pairs]
        if MUON_NAMES.search(name):
            optimizers = [torch.optim.Muon([p], **muon) for p in params]
        else:
            lr = s.lr * (ROUTER_LR if name.endswith("mlp.gate.weight") else 1.0)
            decay = s.weight_decay if weight.dim() >= 2 else 0.0
            optimizers = [torch.optim.AdamW(params, lr=lr, betas=s.betas, eps=s.eps, weight_decay=decay)]
        for _ in range(steps):
            for p, (_, g), optimizer in zip(params, pairs, optimizers):
                p.grad = g.clone()
                optimizer.step()
        out[name] = torch.stack([p.detach() for p in params]) if fused else params[0].detach()
    return out


def _named_state(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: state for p, state in trainer.optimizer.state.items()}


@needs_muon
def test_two_steps_equal_torch_muon_per_matrix_and_adamw_on_the_rest():
    from moeflow.train.optimizers import build_optimizer

    s = settings(optimizer="muon", router_lr_multiplier=ROUTER_LR, weight_decay=0.1)
    model = _model()
    grads = _gradients(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if compat.is_transformers_v5():  # the per-slice path is what this stack needs
        assert any(w.dim() == 3 and MUON_NAMES.search(n) for n, w in start.items())
    optimizer = build_optimizer(model, s)
    for _ in range(2):
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        set_learning_rate(optimizer, s.lr)  # as the Trainer sets it
        optimizer.step()
    want = _reference(start, grads, s, steps=2)
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert sorted(got) == sorted(want)
    moved = [n for n in got if not torch.equal(got[n], start[n])]
    assert len(moved) == len(got)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    # Muon's one buffer for the matrices, AdamW's moments for the rest
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {names[id(p)]: set(state) for p, state in optimizer.state.items()}
    assert {n for n, k in kinds.items() if k == {"momentum_buffer"}} == {n for n in got if MUON_NAMES.search(n)}
    assert {n for n, k in kinds.items() if k == {"step", "exp_avg", "exp_avg_sq"}} == {
        n for n in got if not MUON_NAMES.search(n)
    }


@needs_muon
def test_a_resumed_run_equals_the_uninterrupted_one_momentum_buffers_included(tmp_path):
    s = settings(optimizer="muon")
    whole = make_trainer(train_settings=s)
    whole.run(until=2)
    first = make_trainer(train_settings=s)
    first.run(until=1)
    first.save(tmp_path / "step-00000001")
    resumed = Trainer(_model(seed=1), s, packed_rows(), collate_fn=collate, seed=0)
    resumed.load(tmp_path / "step-00000001")
    saved, loaded = _named_state(first), _named_state(resumed)
    assert sorted(loaded) == sorted(saved)
    buffers = [n for n in saved if "momentum_buffer" in saved[n]]
    assert buffers and all(torch.equal(loaded[n]["momentum_buffer"], saved[n]["momentum_buffer"]) for n in buffers)
    resumed.run(until=2)
    assert losses(resumed) == losses(whole)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    want, got = _named_state(whole), _named_state(resumed)
    assert sorted(got) == sorted(want)
    for name in want:
        assert sorted(got[name]) == sorted(want[name])
        assert all(torch.equal(got[name][k], want[name][k]) for k in want[name]), name


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=needs_muon)])
def test_the_planners_optimizer_state_is_the_state_the_optimizer_holds_after_a_step(optimizer):
    trainer = make_trainer(train_settings=settings(optimizer=optimizer))
    trainer.run(until=1)
    held = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim()  # AdamW's 0-d step counters are left out of the plan
    )
    shape, params, _ = count_parameters(tiny_model_cfg(), VOCAB)
    job = Job(
        precision="fp32",
        method="full",
        micro_batch_size=2,
        seq_len=32,
        gradient_checkpointing=False,
        attn_implementation="sdpa",
        device="cpu",
        num_devices=1,
        expert_parallel=False,
        lora=typed(LoraSettings, {}),
        loss_chunk_tokens=1024,
        ranks_per_node=1,
        optimizer=optimizer,
    )
    assert resident_state(shape, params, job)["optimizer"] == held
    # FSDP over 2 ranks: each holds half of it; Muon's step also gathers one parameter whole (3 fp32 copies)
    fsdp = dataclasses.replace(job, num_devices=2, ranks_per_node=2)
    assert resident_state(shape, params, fsdp)["optimizer"] == math.ceil(held / 2)
    gathered = 3 * params.largest_tensor * 4 if optimizer == "muon" else 0
    assert memory_per_device(shape, params, fsdp)["optimizer"] == math.ceil(held / 2) + gathered


def _config(optimizer: str, strategy: str = "none", method: str = "full") -> dict:
    train = {"optimizer": optimizer, "method": method}
    return {"train": train, "pretrain": {"optimizer": "adamw", "method": "full"}, "parallel": {"strategy": strategy}}


def test_muon_is_refused_at_config_check_where_it_is_not_implemented():
    stack = [] if compat.torch_has_muon() else ["torch.optim.Muon"]
    assert optimizer_problems(_config("adamw", "fsdp", "lora")) == []
    problems = optimizer_problems(_config("muon"))
    assert [p for p in problems if "torch.optim.Muon" in p] == ([problems[0]] if stack else [])
    assert all(p.startswith("config key 'train.optimizer'") for p in problems)
    assert len(optimizer_problems(_config("muon", "fsdp"))) == len(stack)
    assert len(optimizer_problems(_config("muon", "ep"))) == len(stack)  # #36 item 4: Muon under ep
    lora = optimizer_problems(_config("muon", method="lora"))
    assert len(lora) == len(stack) + 1 and "method: full" in lora[-1]


@pytest.mark.skipif(hasattr(torch.optim, "Muon"), reason="this stack has torch.optim.Muon")
def test_muon_is_refused_on_the_pinned_stack_naming_the_key():
    assert not compat.torch_has_muon()
    (problem,) = optimizer_problems(_config("muon"))
    assert problem.startswith("config key 'train.optimizer'") and "STACK=current" in problem
    from moeflow.train.optimizers import OptimizerConfigError, build_optimizer

    with pytest.raises(OptimizerConfigError, match="train.optimizer"):
        build_optimizer(_model(), settings(optimizer="muon"))


@needs_muon
def test_the_muon_settings_reach_training_only_with_optimizer_muon():
    from moeflow.workflow.keys import train_settings
    from moeflow.workflow.load import load

    smoke = Path(__file__).resolve().parents[2] / "config" / "smoke.yaml"
    assert train_settings(load(smoke))["muon"] is None  # adamw: muon's settings never rerun it
    tuned = load(smoke, overrides={"train": {"optimizer": "muon", "muon": {"ns_steps": 3}}})
    s = typed(TrainSettings, train_settings(tuned))
    assert (s.optimizer, s.muon.ns_steps, s.muon.adjust_lr) == ("muon", 3, "match_rms_adamw")


# --------------------------------------------------------------------------- FSDP2: each matrix gathered whole


def _set_gradients(model: torch.nn.Module) -> None:
    """The same seeded gradient of every parameter in every layout (this rank's shard of it under FSDP2)."""
    from moeflow.model.parameters import clean_name
    from moeflow.parallel.layouts import original_shape

    generator = torch.Generator().manual_seed(5)
    for _, p in sorted(model.named_parameters(), key=lambda np: clean_name(np[0])):
        whole = torch.randn(tuple(original_shape(p)), generator=generator) * 1e-2
        if dtensors.is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = whole


def _muon_steps(model: torch.nn.Module, steps: int, fresh=None, folder: Path | None = None):
    """``steps`` Muon steps on the seeded gradients; with ``fresh`` (a model) the state goes through a checkpoint
    at ``folder`` after the first step and the fresh model and optimizer take the rest. Returns (model,
    optimizer) that took the last step."""
    from moeflow.checkpoint.state import load_checkpoint, save_checkpoint
    from moeflow.train.optimizers import build_optimizer

    s = settings(optimizer="muon", router_lr_multiplier=ROUTER_LR)
    optimizer = build_optimizer(model, s)
    for step in range(steps):
        if step == 1 and fresh is not None:
            save_checkpoint(folder, model, optimizer, {"history": []}, [])
            model, optimizer = fresh, build_optimizer(fresh, s)
            load_checkpoint(folder, model, optimizer)
        _set_gradients(model)
        set_learning_rate(optimizer, s.lr)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _main_fsdp(out: str, strategy: str = "fsdp") -> None:
    """One of two ranks: FSDP2 (two Muon steps with a checkpoint between them) or expert parallelism (two steps of
    a model loaded from ``out/model``); rank 0 saves the whole state and the shapes Muon gathered whole."""
    import json

    from safetensors.torch import save_file

    from moeflow.loading.factory import Layout
    from moeflow.parallel.layouts import full_state_dict, shard_model
    from moeflow.parallel.process_group import process_group
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.train import optimizers

    torch.set_num_threads(1)
    gathered, gathered_step = [], optimizers.gathered_step
    optimizers.gathered_step = lambda p, *a: gathered.append(list(p.shape)) or gathered_step(p, *a)
    with process_group("cpu") as ranks:
        if strategy == "ep":
            layout = Layout(ranks, typed(ParallelSettings, {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2}))
            untied = tiny_model_cfg(tie_word_embeddings=False)  # transformers' ep unties them: refused tied
            model = make_model(typed(ModelSettings, untied), folder=f"{out}/model", layout=layout)
            model, optimizer = _muon_steps(model, 2)
        else:
            parallel = typed(ParallelSettings, {"strategy": "fsdp"})
            model, fresh = (shard_model(_model(seed), parallel, ranks, "fp32") for seed in (0, 1))
            model, optimizer = _muon_steps(model, 2, fresh, Path(out) / "checkpoint")
        assert any(dtensors.is_dtensor(p) for p in model.parameters())
        weights, optim_state = full_state_dict(model, optimizer)
        names = {i: n for i, n in enumerate(n for g in optim_state["param_groups"] for n in g["params"])}
        buffers = {
            f"{names.get(k, k)}/momentum_buffer": v["momentum_buffer"]
            for k, v in optim_state["state"].items()
            if "momentum_buffer" in v
        }
        if ranks.is_main:
            save_file(
                {k: v.contiguous() for k, v in {**weights, **buffers}.items()}, str(Path(out) / "state.safetensors")
            )
            (Path(out) / "gathered.json").write_text(json.dumps(gathered))


def _two_ranks(out: Path, strategy: str) -> dict[str, torch.Tensor]:
    """:func:`_main_fsdp` on two gloo ranks: the whole state rank 0 saved; the shapes gathered are checked."""
    import json

    from safetensors.torch import load_file

    from moeflow.parallel.launch import torchrun_command
    from moeflow.settings import REPO_ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=2)) + [__file__, str(out), strategy]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # #36 item 4: a fused [E, out, in] expert tensor split by experts is updated where it lies, never gathered;
    # the 2-D matrices FSDP2 splits by rows are gathered whole
    gathered = json.loads((out / "gathered.json").read_text())
    assert gathered and all(len(shape) == 2 for shape in gathered), gathered
    return load_file(str(out / "state.safetensors"))


@needs_muon
def test_muon_under_expert_parallelism_gives_one_processes_update(tmp_path):
    """#36 item 4: Muon under ep, each rank updating its own experts: the update of every tensor within 1% of one
    process's (the experts' Newton-Schulz sees the same whole matrices; only the reductions' order differs)."""
    from moeflow.parallel.layouts import full_state_dict

    start = _model(tie_word_embeddings=False)
    before = {k: v.clone() for k, v in start.state_dict().items()}
    start.save_pretrained(tmp_path / "model")
    got = _two_ranks(tmp_path, "ep")
    model, optimizer = _muon_steps(_model(tie_word_embeddings=False), 2)
    want, _ = full_state_dict(model, optimizer)
    assert set(want) <= set(got)
    off = [n for n in want if float((got[n] - want[n]).norm()) > 1e-2 * float((want[n] - before[n]).norm()) + 1e-7]
    assert off == [], off


@needs_muon
def test_fsdp2_muon_updates_each_whole_matrix_as_one_process_does_through_a_checkpoint(tmp_path):
    from moeflow.parallel.layouts import full_state_dict

    got = _two_ranks(tmp_path, "fsdp")
    model, optimizer = _muon_steps(_model(), 2)
    weights, optim_state = full_state_dict(model, optimizer)
    names = {i: n for i, n in enumerate(n for g in optim_state["param_groups"] for n in g["params"])}
    want = dict(weights)
    want |= {
        f"{names.get(k, k)}/momentum_buffer": v["momentum_buffer"]
        for k, v in optim_state["state"].items()
        if "momentum_buffer" in v
    }
    assert sorted(got) == sorted(want) and any(k.endswith("momentum_buffer") for k in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


if __name__ == "__main__":
    _main_fsdp(*sys.argv[1:3])
