"""Two CPU ranks (gloo, started by torchrun) give the gradients of one process on the same global batch.

Each layout runs one optimizer step's forward and backward with the training loop's own step
(``moeflow.train.trainer.accumulate_gradients``: token-normalised cross-entropy plus the global-batch balancing
loss and z-loss, counts all-reduced), then ``moeflow.parallel.gradients.reduce_gradients``; rank 0 saves the
whole gradients, which must equal one process's on the concatenated batch (relative error < 1e-5).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model_cfg

from moeflow.model.parameters import clean_name
from moeflow.model.settings import ModelSettings
from moeflow.model.wrappers import unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.gradients import clip_grad_norm, full_gradients, reduce_gradients
from moeflow.parallel.launch import torchrun_command
from moeflow.parallel.layouts import (
    distributed_config,
    full_state_dict,
    is_sharded,
    original_shape,
    shard_model,
)
from moeflow.parallel.process_group import DistributedError, init, process_group, teardown, world_size
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.settings import BalanceSettings

SETTINGS = typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=False))
VOCAB = 96
LOSS = {"mode": "running", "coef": 0.01, "z_loss_coef": 0.001}
RANKS = 2
ROWS_PER_RANK = 2
LR = 0.5


def packed_rows(seed: int = 0) -> list[dict]:
    """Packed rows of varied lengths, each holding two documents (positions restart, label -100 at a start)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (40, 23, 31, 40):
        first = int(torch.randint(5, length - 5, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        positions = list(range(first)) + list(range(length - first))
        labels = [(-100 if p == 0 else t) for t, p in zip(ids, positions)]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def optimizer_for(model) -> torch.optim.Optimizer:
    """SGD with momentum: linear in the gradient, with a state to round-trip. (AdamW's first step is about
    lr x sign(g), so gradients equal to 1e-7 could still flip the update of an element that is nearly 0.)"""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def bf16_autocast():
    """The Trainer's autocast with ``precision: bf16`` (moeflow.train.trainer.Trainer.autocast), on the CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def one_step(model, rows_per_micro_batch: list[list[dict]], autocast=contextlib.nullcontext):
    """The training loop's step on these micro-batches; returns its StepLoss."""
    from moeflow.data.collate import collate
    from moeflow.model.routing import adapter_or_none
    from moeflow.train.trainer import accumulate_gradients

    batches = [collate(rows) for rows in rows_per_micro_batch]
    return accumulate_gradients(
        model,
        batches,
        typed(BalanceSettings, LOSS),
        adapter_or_none(unwrap(model)),
        autocast,
    )


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    from moeflow.loading.factory import make_model

    folder = tmp_path_factory.mktemp("dist") / "model"
    make_model(SETTINGS, vocab_size=VOCAB, seed=3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference_model(saved_model):
    """One process, one micro-batch holding every rank's rows; then one optimizer step."""
    from moeflow.loading.factory import make_model

    model = make_model(SETTINGS, folder=saved_model)
    model.config.use_cache = False
    model.train()
    one_step(model, [packed_rows()])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer_for(model).step()
    return grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(reference_model) -> dict[str, torch.Tensor]:
    return reference_model[0]


def run_ranks(
    saved_model: Path, out: Path, parallel: dict, harness: str = "step", ranks: int = RANKS
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT / "src"), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
        ),
        "OMP_NUM_THREADS": "1",
    }
    out.mkdir(parents=True, exist_ok=True)
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=ranks)) + [
        __file__,
        str(saved_model),
        str(out),
        json.dumps(parallel),
        harness,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    diff = torch.sqrt(sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want))
    norm = torch.sqrt(sum((want[n].double() ** 2).sum() for n in want))
    print(f"relative gradient error vs one process: {float(diff / norm):.1e}")  # shown with pytest -s
    assert float(diff / norm) < 1e-5, f"relative error {float(diff / norm):.2e}"
    for name in want:  # and no parameter is off on its own
        scale = max(float(want[name].norm()), 1e-3 * float(norm))
        assert float((got[name] - want[name]).norm()) / scale < 1e-4, name


def whole_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The whole state after one optimizer step (gathered by full_state_dict) equals one process's."""
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["none", "fsdp"])
def test_two_ranks_give_the_gradients_of_one_process(saved_model, reference, reference_model, tmp_path, strategy):
    run_ranks(saved_model, tmp_path, {"strategy": strategy})
    from safetensors.torch import load_file

    assert_same_gradients(load_file(str(tmp_path / "grads.safetensors")), reference)
    assert_same_weights(load_file(str(tmp_path / "weights.safetensors")), reference_model[1])
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["label_tokens"] == sum(sum(1 for x in r["labels"][1:] if x != -100) for r in packed_rows())
    assert report["sharded"] == (strategy == "fsdp")
    assert report["grad_norm"] == pytest.approx(whole_norm(reference), rel=1e-5)
    # the shapes AdamW's groups go by (weight decay on 2-D and larger) survive the sharding
    assert report["shapes"] == {n: list(g.shape) for n, g in reference.items()}


@pytest.mark.skipif(
    not compat.is_transformers_v5(),
    reason="expert parallelism is transformers 5 only (the pinned stack raises: see below)",
)
def test_expert_parallel_plus_fsdp_gives_the_gradients_of_one_process(
    saved_model, reference, reference_model, tmp_path
):
    run_ranks(saved_model, tmp_path, {"strategy": "ep", "ep_size": 2, "fsdp_size": 2})
    from safetensors.torch import load_file

    assert_same_gradients(load_file(str(tmp_path / "grads.safetensors")), reference)
    assert_same_weights(load_file(str(tmp_path / "weights.safetensors")), reference_model[1])
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["sharded"] and report["grad_norm"] == pytest.approx(whole_norm(reference), rel=1e-5)


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="expert parallelism is transformers 5 only")
def test_expert_parallel_inside_a_wider_fsdp_clips_on_the_whole_gradient(saved_model, reference, tmp_path):
    """#36 item 2: ep_size 2 inside fsdp_size 4 places the experts (_StridedShard(0), Shard(0)), whose strided
    placement's is_shard() is False: the norm must still count every rank's expert rows. Four ranks in that layout
    and four plain FSDP ranks give one process's norm at step 1 and the same clipped gradients."""
    from safetensors.torch import load_file

    norm = whole_norm(reference)
    coef = (norm / 2) / (norm + 1e-6)
    for name, parallel in (("ep", {"strategy": "ep", "ep_size": 2, "fsdp_size": 4}), ("fsdp", {"strategy": "fsdp"})):
        run_ranks(saved_model, tmp_path / name, parallel, ranks=4)
        report = json.loads((tmp_path / name / "rank0.json").read_text())
        assert report["grad_norm"] == pytest.approx(norm, rel=1e-5), name
        assert_same_gradients(
            load_file(str(tmp_path / name / "clipped.safetensors")), {n: g * coef for n, g in reference.items()}
        )


@pytest.mark.skipif(compat.is_transformers_v5(), reason="transformers 5 has expert parallelism")
def test_expert_parallel_on_the_pinned_stack_is_a_clear_error():
    with pytest.raises(DistributedError, match="no expert parallelism.*STACK=current"):
        distributed_config(
            typed(ParallelSettings, {"strategy": "ep", "ep_size": 2, "fsdp_size": 2}),
            "fp32",
            world=2,
        )


def checkpoint_round_trip(folder: Path, saved, fresh) -> None:
    """``saved``'s (model, optimizer) state through a checkpoint into ``fresh``'s (every rank calls it)."""
    from moeflow.checkpoint.state import load_checkpoint, save_checkpoint

    save_checkpoint(folder, *saved, {"history": []}, [])
    load_checkpoint(folder, *fresh)


def test_state_round_trips_in_one_process(saved_model, reference_model, tmp_path):
    """One process's whole state is the sharded layouts' (names, whole tensors), and its checkpoint loads
    into a fresh model and optimizer exactly."""
    from moeflow.loading.factory import make_model

    model = make_model(SETTINGS, folder=saved_model)
    model.config.use_cache = False
    one_step(model, [packed_rows()])
    optimizer = optimizer_for(model)
    optimizer.step()
    weights, optim_state = full_state_dict(model, optimizer)
    assert_same_weights(weights, reference_model[1])
    assert sorted(optim_state["state"]) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    fresh = make_model(SETTINGS, folder=saved_model)
    fresh_optimizer = optimizer_for(fresh)
    checkpoint_round_trip(tmp_path / "checkpoint", (model, optimizer), (fresh, fresh_optimizer))
    again, again_optim = full_state_dict(fresh, fresh_optimizer)
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert json.dumps(_tensor_free(again_optim)) == json.dumps(_tensor_free(optim_state))


def test_bf16_fsdp_computes_in_bf16_over_fp32_masters_and_gives_the_bf16_gradient(saved_model, tmp_path):
    """precision: bf16 with strategy: fsdp: FSDP's mixed precision (bf16 gathers and compute, fp32 shards,
    fp32 reduction), and no whole-model .to(device) before sharding (on CUDA: the whole model on one GPU)."""
    from moeflow.loading.factory import make_model

    run_ranks(saved_model, tmp_path, {"strategy": "fsdp"}, harness="bf16")
    from safetensors.torch import load_file

    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["masters"] == ["torch.float32"]  # AdamW's master weights
    assert report["forward_weights"] and set(report["forward_weights"]) == {"torch.bfloat16"}
    assert report["gradients"] == ["torch.float32"] and report["saved_weights"] == ["torch.float32"]
    assert report["moved"].count("Qwen3MoeForCausalLM") == 0, report["moved"]
    # one process computing in bf16 (weights cast, the Trainer's autocast) on every rank's rows
    single = make_model(SETTINGS, folder=saved_model).to(torch.bfloat16)
    single.config.use_cache = False
    single.train()
    one_step(single, [packed_rows()], bf16_autocast)
    want = {n: p.grad.float() for n, p in single.named_parameters() if p.grad is not None}
    got = load_file(str(tmp_path / "grads.safetensors"))
    assert sorted(got) == sorted(want)
    error = float(torch.sqrt(sum(((got[n] - want[n]).double() ** 2).sum() for n in want))) / whole_norm(want)
    print(f"relative gradient error vs one bf16 process: {error:.1e}")
    assert error < 2e-2


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="expert parallelism is transformers 5 only")
def test_expert_parallel_bf16_asks_transformers_for_fsdp_mixed_precision():
    parallel = typed(ParallelSettings, {"strategy": "ep", "ep_size": 2, "fsdp_size": 2})
    assert distributed_config(parallel, "bf16", world=2).fsdp_mixed_precision
    assert not distributed_config(parallel, "fp32", world=2).fsdp_mixed_precision


def test_one_process_needs_no_process_group():
    ranks = init("cpu")
    assert (ranks.rank, ranks.world_size, ranks.device.type) == (0, 1, "cpu") and ranks.is_main
    assert world_size() == 1
    teardown()


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="expert parallelism is transformers 5 only")
def test_expert_parallel_load_reads_each_ranks_experts_and_equals_from_pretrained(saved_model, tmp_path):
    """``ep`` builds the model on the meta device, shards it as transformers' ``from_pretrained`` does for its
    DistributedConfig, then each rank reads from the files only its own experts' tensors (and its rows of the
    rest): every rank's local tensors and placements equal ``from_pretrained(distributed_config=...)``'s."""
    run_ranks(saved_model, tmp_path, {"strategy": "ep", "ep_size": 2, "fsdp_size": 2}, harness="ep_load")
    experts = 4 // RANKS  # tiny_model_cfg's 4 experts, 2 layers
    for r in range(RANKS):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["from_pretrained_calls"] == 0
        assert report["differ"] == [] and report["compared"] > 0
        assert report["experts_read"] == {
            str(layer): list(range(r * experts, (r + 1) * experts)) for layer in range(2)
        }, report["experts_read"]


def _tensor_free(state):
    """An optimizer state with each tensor replaced by its values' sum (for an exact comparison)."""
    if isinstance(state, dict):
        return {str(k): _tensor_free(v) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))}
    if isinstance(state, (list, tuple)):
        return [_tensor_free(v) for v in state]
    if isinstance(state, torch.Tensor):
        return [list(state.shape), float(state.double().sum())]
    return state


def _main(saved_model: str, out: str, parallel_json: str) -> None:
    """One rank: load, shard, one step on this rank's rows, reduce; rank 0 saves the whole gradients."""
    from safetensors.torch import save_file

    from moeflow.loading.factory import Layout, make_model

    torch.set_num_threads(1)
    parallel = typed(ParallelSettings, json.loads(parallel_json))
    with process_group("cpu") as ranks:
        if parallel.strategy == "ep":
            model = make_model(SETTINGS, folder=saved_model, layout=Layout(ranks, parallel))
        else:
            model = make_model(SETTINGS, folder=saved_model)
        model.config.use_cache = False
        model.train()
        model = shard_model(model, parallel, ranks, "fp32")
        per_rank = len(packed_rows()) // ranks.world_size
        mine = packed_rows()[ranks.rank * per_rank : (ranks.rank + 1) * per_rank]
        step = one_step(model, [mine])
        reduce_gradients(model)
        grad_norm = clip_grad_norm(model, float("inf"))  # the whole model's norm, clipping nothing
        grads = full_gradients(model)
        optimizer = optimizer_for(model)
        optimizer.step()
        weights, optim_state = full_state_dict(model, optimizer)
        # this rank's checkpoint shards load into a freshly sharded model and optimizer: the same whole state
        fresh = (
            make_model(SETTINGS, folder=saved_model, layout=Layout(ranks, parallel))
            if parallel.strategy == "ep"
            else make_model(SETTINGS, folder=saved_model)
        )
        fresh = shard_model(fresh, parallel, ranks, "fp32")
        fresh_optimizer = optimizer_for(fresh)
        checkpoint_round_trip(Path(out) / "checkpoint", (model, optimizer), (fresh, fresh_optimizer))
        again, again_optim = full_state_dict(fresh, fresh_optimizer)
        assert sorted(again) == sorted(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
        assert json.dumps(_tensor_free(again_optim)) == json.dumps(_tensor_free(optim_state))
        clip_grad_norm(model, grad_norm / 2)  # now it clips: every gradient scaled by about a half
        clipped = full_gradients(model)
        if ranks.is_main:
            save_file({k: v.contiguous() for k, v in grads.items()}, str(Path(out) / "grads.safetensors"))
            save_file({k: v.contiguous() for k, v in clipped.items()}, str(Path(out) / "clipped.safetensors"))
            save_file({k: v.contiguous() for k, v in weights.items()}, str(Path(out) / "weights.safetensors"))
            shapes = {clean_name(n): list(original_shape(p)) for n, p in model.named_parameters()}
            report = {
                "label_tokens": step.num_label_tokens,
                "sharded": is_sharded(model),
                "grad_norm": grad_norm,
                "shapes": shapes,
            }
            (Path(out) / "rank0.json").write_text(json.dumps(report))


def _main_bf16(saved_model: str, out: str, parallel_json: str) -> None:
    """One rank of ``precision: bf16`` under FSDP: what moves where while sharding, the dtypes of the shards,
    of the weights a forward sees and of the reduced gradients; rank 0 saves the whole gradients."""
    from safetensors.torch import save_file

    from moeflow.loading.factory import make_model

    torch.set_num_threads(1)
    parallel = typed(ParallelSettings, json.loads(parallel_json))
    with process_group("cpu") as ranks:
        model = make_model(SETTINGS, folder=saved_model)
        model.config.use_cache = False
        model.train()
        moved, to = [], torch.nn.Module.to

        def recording_to(module, *args, **kwargs):
            moved.append(type(module).__name__)
            return to(module, *args, **kwargs)

        torch.nn.Module.to = recording_to
        try:
            model = shard_model(model, parallel, ranks, "bf16")
        finally:
            torch.nn.Module.to = to
        masters = sorted({str(p.dtype) for p in model.parameters()})
        seen = []
        projection = unwrap(model).model.layers[0].self_attn.q_proj
        projection.register_forward_pre_hook(lambda module, args: seen.append(str(module.weight.dtype)))
        mine = packed_rows()[ranks.rank * ROWS_PER_RANK : (ranks.rank + 1) * ROWS_PER_RANK]
        one_step(model, [mine], bf16_autocast)
        reduce_gradients(model)
        grads = full_gradients(model)
        weights, _ = full_state_dict(model)
        if ranks.is_main:
            save_file({k: v.contiguous() for k, v in grads.items()}, str(Path(out) / "grads.safetensors"))
            report = {
                "moved": moved,
                "masters": masters,
                "forward_weights": seen,
                "gradients": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
                "saved_weights": sorted({str(w.dtype) for w in weights.values()}),
            }
            (Path(out) / "rank0.json").write_text(json.dumps(report))


def _main_ep_load(saved_model: str, out: str, parallel_json: str) -> None:
    """One rank of the ``ep`` load: which experts' file tensors it reads, and its local tensors against
    ``from_pretrained``'s with transformers' own sharding."""
    import re

    from moeflow.loading.factory import Layout, make_model
    from moeflow.model.configs import causal_lm_class
    from moeflow.parallel import rank_load

    torch.set_num_threads(1)
    parallel = typed(ParallelSettings, json.loads(parallel_json))
    with process_group("cpu") as ranks:
        auto_class, reads, calls = causal_lm_class(), [], []
        read_tensor, from_pretrained = rank_load.read_tensor, auto_class.from_pretrained
        rank_load.read_tensor = lambda file, entry, *a, **k: (
            reads.append(entry.name) or read_tensor(file, entry, *a, **k)
        )
        auto_class.from_pretrained = lambda *a, **k: calls.append(a) or from_pretrained(*a, **k)
        try:
            model = make_model(SETTINGS, folder=saved_model, layout=Layout(ranks, parallel))
        finally:
            rank_load.read_tensor, auto_class.from_pretrained = read_tensor, from_pretrained
        want = from_pretrained(
            saved_model, distributed_config=distributed_config(parallel, "fp32"), experts_implementation="eager"
        )
        got_state, want_state = dict(model.state_dict()), dict(want.state_dict())
        assert sorted(got_state) == sorted(want_state)
        differ = [
            name
            for name, value in want_state.items()
            if getattr(value, "placements", None) != getattr(got_state[name], "placements", None)
            or not torch.equal(_local(value), _local(got_state[name]))
        ]
        experts: dict[str, set[int]] = {}
        for name in reads:
            if found := re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.", name):
                experts.setdefault(found[1], set()).add(int(found[2]))
        report = {
            "from_pretrained_calls": len(calls),
            "differ": differ,
            "compared": len(want_state),
            "experts_read": {layer: sorted(e) for layer, e in sorted(experts.items())},
        }
        (Path(out) / f"rank{ranks.rank}.json").write_text(json.dumps(report))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if dtensors.is_dtensor(value) else value


if __name__ == "__main__":
    {"step": _main, "bf16": _main_bf16, "ep_load": _main_ep_load}[sys.argv[4]](*sys.argv[1:4])


NODE_INTERFACES = ["lo", "docker0", "eno1", "ib0", "ib1"]


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, None),
        ({"GLOO_SOCKET_IFNAME": "eno1"}, "eno1"),  # the launch environment's own choice
        ({"GLOO_SOCKET_IFNAME": "ib1", "NCCL_SOCKET_IFNAME": "ib0"}, "ib1"),
        ({"NCCL_SOCKET_IFNAME": "ib"}, "ib0"),  # a prefix: the first interface it matches
        ({"NCCL_SOCKET_IFNAME": "=ib1"}, "ib1"),  # exact names
        ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, "eno1"),  # excluded ones
        ({"NCCL_SOCKET_IFNAME": "^eno,docker,ib"}, None),  # nothing left but the loopback: never that
        ({"NCCL_SOCKET_IFNAME": "eth"}, None),
    ],
)
def test_gloo_binds_to_the_interface_nccl_is_told_to_use(environ, want):
    from moeflow.parallel.process_group import gloo_socket_ifname

    assert gloo_socket_ifname(environ, NODE_INTERFACES) == want


def test_ranks_on_several_nodes_set_gloos_interface_before_joining(monkeypatch, caplog):
    import socket

    from moeflow.parallel import process_group as pg

    monkeypatch.setattr(socket, "if_nameindex", lambda: list(enumerate(NODE_INTERFACES, 1)))
    # set before deleting, so that monkeypatch restores the variable's state before the test (delenv of an
    # absent variable records nothing, and the value _set_gloo_interface sets would outlive the test)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset-by-this-test")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one node: left to gloo's default
    pg._set_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # two nodes
    pg._set_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    with caplog.at_level("WARNING", logger="moeflow.parallel.process_group"):
        pg._set_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "export NCCL_SOCKET_IFNAME" in caplog.text
