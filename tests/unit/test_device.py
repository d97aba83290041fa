"""A training step as it would run on a GPU, checked on the CPU (tests/device_check.py): no operation
mixes device and host tensors, and the host waits for the device a fixed, small number of times per
optimizer step. Plus the stages' refusal of a missing GPU and the per-step peak memory reading."""

from __future__ import annotations

import pytest
import torch
from device_check import DeviceCheck, DeviceMixError
from tiny_models import model_config

from moeflow.data.collate import collate
from moeflow.loading.factory import make_model
from moeflow.model import device
from moeflow.model.settings import ModelSettings
from moeflow.parallel import gradients
from moeflow.parallel.gradients import clip_grad_norm
from moeflow.runtime import host_copies
from moeflow.settings import typed
from moeflow.train.peak_memory import PhasePeaks
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

VOCAB = 97
# What the step itself may read back per optimizer step: the loss summary (StepLoss.summary) and the
# gradient norm (clip_grad_norm). Independent of the micro-batches and the parameters.
SYNCS_PER_STEP = 2


def rows(n=16, seed=0):
    """One document per row of varied length: the collated micro-batches carry padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        length = int(torch.randint(8, 24, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        labels = [-100] + ids[1:]
        out.append({"input_ids": ids, "labels": labels, "position_ids": list(range(length)), "doc_ids": [r] * length})
    return out


def trainer(balance: dict, dense: bool = False, grad_accum_steps: int = 2, max_grad_norm: float = 0.05) -> Trainer:
    cfg = model_config("qwen3_moe", "sdpa")
    if dense:
        cfg["config"] |= {"num_experts": 0, "intermediate_size": 32}
    model = make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=0)
    section = {
        "steps": 4,
        "lr": 1e-3,
        "micro_batch_size": 2,
        "grad_accum_steps": grad_accum_steps,
        "max_grad_norm": max_grad_norm,
        "balance": balance,
        "memory_guard": {"skip_steps": 100},
    }
    settings = typed(TrainSettings, training(section))
    return Trainer(model, settings, rows(), collate_fn=collate, seed=0)


def checked_steps(t: Trainer, steps: int = 2) -> tuple[DeviceCheck, list[dict]]:
    """``steps`` optimizer steps under the device check (the first creates the optimizer state)."""
    with DeviceCheck() as check:
        check.place_model(t.model)
        records = [t.train_step() for _ in range(steps)]
    return check, records


def moeflow_syncs(check: DeviceCheck) -> list:
    """The step's own read-backs (transformers' MoE blocks of 4.57 sync per expert: not ours to fix)."""
    return [s for s in check.syncs if s.origin == "moeflow"]


BALANCE = {
    "running+z": {"mode": "running", "coef": 0.01, "z_loss_coef": 0.001},
    "exact": {"mode": "exact", "coef": 0.05},
    "micro_batch": {"mode": "micro_batch", "coef": 0.05, "z_loss_coef": 0.001},
}


@pytest.mark.parametrize("mode", list(BALANCE))
def test_moe_training_step_keeps_its_tensors_on_the_device(mode):
    check, records = checked_steps(trainer(BALANCE[mode]))
    assert records[-1]["balance_loss"] > 0 and records[-1]["grad_norm"] > 0.05  # balancing and clipping ran
    assert len(moeflow_syncs(check)) <= SYNCS_PER_STEP * len(records), check.sync_report("moeflow")


@pytest.mark.parametrize("mode", ["running", "exact"])
def test_dense_model_trains_in_every_balance_mode_without_a_balancing_loss(mode):
    check, records = checked_steps(trainer({"mode": mode, "coef": 0.05}, dense=True))
    assert [r["balance_loss"] for r in records] == [0.0, 0.0] and records[-1]["routing"] == []
    assert len(moeflow_syncs(check)) <= SYNCS_PER_STEP * len(records), check.sync_report("moeflow")


def test_host_reads_per_step_do_not_grow_with_micro_batches_or_parameters(monkeypatch):
    counts = []
    for accum in (1, 4):
        check, records = checked_steps(trainer(BALANCE["running+z"], grad_accum_steps=accum))
        counts.append(len(moeflow_syncs(check)))
        assert counts[-1] <= SYNCS_PER_STEP * len(records), f"{accum} micro-batches:\n{check.sync_report('moeflow')}"
    assert counts[0] == counts[1]
    # the sharded models' clipping (FSDP1's flat parameters): one read-back for all parameters
    t = trainer(BALANCE["running+z"])
    monkeypatch.setattr(gradients, "is_fsdp1", lambda model: True)
    check, records = checked_steps(t)
    assert len(moeflow_syncs(check)) <= SYNCS_PER_STEP * len(records), check.sync_report("moeflow")


def test_sharded_clipping_sums_norms_in_parameter_order_like_the_unsharded_one(monkeypatch):
    """The FSDP1/DTensor path (one foreach norm, squares summed in parameter order) against torch's own."""
    grads = {}
    for sharded in (False, True):
        t = trainer(BALANCE["exact"])
        t.step_gradients()
        monkeypatch.setattr(gradients, "is_fsdp1", lambda model, sharded=sharded: sharded)
        norm = clip_grad_norm(t.model, 0.05)
        grads[sharded] = (norm, torch.cat([p.grad.reshape(-1) for p in t.model.parameters() if p.grad is not None]))
    assert grads[True][0] == pytest.approx(grads[False][0], rel=1e-6) and grads[True][0] > 0.05
    assert torch.allclose(grads[True][1], grads[False][1], rtol=1e-5, atol=0)


def test_the_check_catches_a_host_tensor_added_to_a_device_tensor():
    model = torch.nn.Linear(3, 3)
    with DeviceCheck() as check, pytest.raises(DeviceMixError, match=r"aten\.add_\.Tensor mixes device tensors"):
        check.place_model(model)
        host = torch.zeros(3)
        host += model(torch.ones(2, 3).to(model.weight.device)).sum(0)
    with DeviceCheck() as check:  # a 0-dim host tensor is fine (CUDA takes it as a scalar); reads are recorded
        check.place_model(model)
        total = model.weight.sum() * torch.tensor(2.0)
        float(total)
        model.weight[model.weight > 0].sum()
    assert [s.what for s in check.syncs] == [
        "scalar read (item/float/int/bool)",
        "boolean-mask indexing (data-dependent shape)",
    ]


# --------------------------------------------------------------------------- stages and memory


def test_a_cuda_config_without_a_gpu_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(device.DeviceUnavailable, match=r"'hardware\.device' is 'cuda'"):
        device.compute_device("cuda")
    assert device.compute_device("cpu") == torch.device("cpu")
    assert device.compute_dtype("bf16") == torch.bfloat16 and device.compute_dtype("fp32") == torch.float32


def test_cuda_memory_reading_is_the_steps_peak(monkeypatch):
    allocator = {"peak": 0, "allocated": 0}

    def allocate(mib):
        allocator["allocated"] += mib * 2**20
        allocator["peak"] = max(allocator["peak"], allocator["allocated"])

    def reset_peak(device=None):
        allocator["peak"] = allocator["allocated"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocator["allocated"])
    peaks = PhasePeaks(torch.device("cuda"))
    readings = []
    for activations in (300, 100):
        with peaks.measure("step"):
            allocate(activations)  # the step's activations and gradients...
            allocate(-activations)  # ...freed by the update and zero_grad
        readings.append(peaks.last / 2**20)
    assert readings == [300, 100] and peaks.bytes == {"step": 300 * 2**20}


def test_host_tensors_go_to_a_gpu_through_pinned_memory():
    """The decision: a CPU tensor bound for CUDA is staged in pinned memory and copied without blocking; to the
    CPU (or from a device tensor) it is a plain ``.to``."""
    host = torch.zeros(2, 3, dtype=torch.long)
    assert host_copies.copies_through_pinned_memory(host, torch.device("cuda"))
    assert host_copies.copies_through_pinned_memory(host, "cuda:1")
    assert not host_copies.copies_through_pinned_memory(host, torch.device("cpu"))
    assert not host_copies.copies_through_pinned_memory(torch.zeros(2, device="meta"), "cuda")
    assert host_copies.to_device(host, torch.device("cpu")) is host


def test_every_host_copy_of_a_training_forward_asks_for_pinned_memory(monkeypatch):
    """The inputs, the positions, the labels (the chunked loss) and the real-token positions (the routing) of a
    forward all go through ``host_copies.to_device``: on a GPU each is a pinned, non-blocking copy."""
    from moeflow.model.routing import adapter_for, capture
    from moeflow.train.losses import real_token_positions
    from moeflow.train.trainer import routed_forward

    asked = []

    def decide(source, device):
        asked.append(source.clone())
        return False  # copy as on the CPU, having asked

    monkeypatch.setattr(host_copies, "copies_through_pinned_memory", decide)
    model = make_model(typed(ModelSettings, model_config("qwen3_moe", "sdpa")), vocab_size=VOCAB, seed=0)
    batch = collate(rows(2))
    assert real_token_positions(batch) is not None  # the rows' lengths differ: padding
    with capture(model, adapter_for(model)) as routing:
        routed_forward(model, batch, routing)
    wanted = {k: batch[k] for k in ("input_ids", "position_ids", "labels")} | {
        "real token positions": real_token_positions(batch)
    }
    for name, tensor in wanted.items():
        assert any(a.shape == tensor.shape and torch.equal(a, tensor) for a in asked), f"{name}: a pageable copy"


def test_a_model_whose_parameters_are_offloaded_computes_on_the_device_it_records():
    """Under CPU offload (moeflow.parallel.layouts) the parameters stay on the host between layers: the inputs go
    where the model computes, which it records, for it and for the model it wraps."""
    from moeflow.model.lora import apply_lora
    from moeflow.model.settings import LoraSettings

    model = make_model(typed(ModelSettings, model_config("qwen3_moe", "sdpa")), vocab_size=VOCAB, seed=0)
    assert host_copies.model_device(model) == torch.device("cpu")
    wrapped = apply_lora(model, typed(LoraSettings, {"targets": ["attention"]}), gradient_checkpointing=False)
    host_copies.set_compute_device(wrapped, torch.device("cuda", 1))  # a label: no GPU is touched
    assert host_copies.model_device(wrapped) == host_copies.model_device(model) == torch.device("cuda", 1)
    assert {p.device.type for p in wrapped.parameters()} == {"cpu"}


def test_no_stage_reads_the_compute_device_from_the_parameters():
    """``next(model.parameters()).device`` is the host under CPU offload: every caller asks model_device."""
    from moeflow.settings import REPO_ROOT

    readers = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for folder in ("src", "workflow")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "parameters()).device" in line and path.name != "host_copies.py"
    ]
    assert readers == [], readers
