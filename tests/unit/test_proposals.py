"""The planner's proposals (moeflow.plan.proposals, #38): over a grid of models in their published shapes and of
hardware, every configuration it proposes passes the config check when its overlay is applied, plans to fit there,
and changes only settings the run does not already have."""

from __future__ import annotations

import functools

import pytest

from moeflow.plan.counts import count_parameters
from moeflow.plan.fit import device_memory, fits
from moeflow.plan.memory import Job, PlanMemoryStage
from moeflow.plan.proposals import host_fits, proposals
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import deep_merge
from moeflow.workflow.method_table import HARDWARE  # the grid of docs/training.md's table

MODELS = {
    "embedded default": (),
    "qwen3-30b-a3b": ("qwen3-30b-a3b",),
    "gpt-oss-20b": ("gpt-oss-20b",),
    "mixtral-8x7b": ("mixtral-8x7b",),
    "deepseek-v3": ("deepseek-v3",),
    "step3p5-flash": ("step3p5-flash",),
}
ENV = {"devices": [], "system": {"ram_usable_bytes": 2048 * 2**30}}  # host memory is not what these plans test
HOST = 256 * 2**30  # a node's host memory, which a CPU-offload proposal must fit in


def files(model: str) -> list:
    return [REPO_ROOT / "config" / "models" / f"{name}.yaml" for name in MODELS[model]]


def hardware(devices: int, gib: int) -> dict:
    """The grid's hardware; a LoRA run (the method of GPT-OSS's file) on whole models, the rest sharded. The
    comparison runs are dropped: each plans the ``moe`` run only."""
    return {
        "hardware": {"device": "cuda", "num_devices": devices, "memory_gib_per_device": gib},
        "parallel": {"nproc_per_node": devices, "nnodes": 1, "strategy": "none", "ep_size": 1, "fsdp_size": None},
        "runs": {"lora": None, "esft": None, "dense": None, "moe-seed2": None},
        "paper": {"dense_runs": [], "noise_run": None},
    }


def settings(model: str, overrides: dict) -> PlanMemoryStage:
    """The moe run's planner settings of the model's config with ``overrides``: load() runs the config check."""
    return typed(PlanMemoryStage, plan_settings(run_config(load(*files(model), overrides=overrides), "moe")))


@functools.cache
def counted(model: str):
    planned = settings(model, hardware(1, 80))
    shape, params, _ = count_parameters(planned.model, planned.vocab_size)
    return shape, params


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def lookup(cfg: dict, dotted: str):
    for key in dotted.split("."):
        cfg = (cfg or {}).get(key)
    return cfg


@pytest.mark.parametrize("model", MODELS)
def test_every_proposal_passes_the_config_check_and_fits(model):
    """A CPU-offload proposal fits a node's host memory too."""
    shape, params = counted(model)
    fitting = 0  # the runs that fit as they are, and the proposals
    for name, (devices, gib) in HARDWARE.items():
        base = hardware(devices, gib)
        planned = settings(model, base)
        memory, _ = device_memory(planned.hardware, ENV)
        job = Job.from_settings(planned)
        fitting += fits(shape, params, job, memory)
        cfg = run_config(load(*files(model), overrides=base), "moe")
        for option in proposals(shape, params, job, memory, planned, HOST):
            where = f"{model} on {name}: {option['change']}"
            changed = leaves(option["overlay"])
            assert changed, where
            assert all(lookup(cfg, key) != value for key, value in changed.items()), where  # nothing already set
            applied = settings(model, deep_merge(base, option["overlay"]))  # the config check accepts it
            variant = Job.from_settings(applied)
            assert fits(shape, params, variant, memory), where
            assert variant.num_devices == option["num_devices"] and variant.strategy == option["strategy"], where
            assert not variant.cpu_offload or host_fits(shape, params, variant, HOST), where
            fitting += 1
    assert fitting, f"{model}: nothing fits anywhere on the grid"


def test_proposals_are_the_cheapest_first_and_a_fitting_run_gets_them_too():
    shape, params = counted("embedded default")
    planned = settings("embedded default", hardware(8, 24))
    memory, _ = device_memory(planned.hardware, ENV)
    job = Job.from_settings(planned)
    assert fits(shape, params, job, memory)
    options = proposals(shape, params, job, memory, planned)
    assert options, "a run that fits is offered the cheaper configurations too"
    costs = [(o["num_devices"], o["step_flops_per_token"], o["bytes_moved_per_micro_batch"]) for o in options]
    assert costs == sorted(costs)
    lora = next(o for o in options if o["overlay"].get("train", {}).get("method") == "lora")
    assert lora["strategy"] == ("fsdp" if compat.fsdp2_available() else "none")
    assert lora["step_flops_per_token"] < 6 * params.active


def offloaded_bf16(options: list[dict]) -> list[dict]:
    """The CPU-offload proposals that keep the base in bf16 (no quantization)."""
    return [o for o in options if o["overlay"].get("parallel", {}).get("cpu_offload") and "model" not in o["overlay"]]


@pytest.mark.skipif(not compat.fsdp2_available(), reason="parallel.cpu_offload is FSDP2's (refused on FSDP1)")
def test_a_run_too_large_for_its_one_card_is_proposed_cpu_offload_on_it_within_the_hosts_memory():
    """Qwen3-30B-A3B LoRA in bf16 on one 24 GiB card: its 57 GiB frozen base fits no card, offloaded it fits the
    card, and a node's host memory bounds the proposal."""
    shape, params = counted("qwen3-30b-a3b")
    base = deep_merge(hardware(1, 24), {"train": {"method": "lora", "optimizer": "adamw", "mtp": {"mode": "frozen"}}})
    base["train"]["gradient_checkpointing"] = True
    planned = settings("qwen3-30b-a3b", base)
    memory, _ = device_memory(planned.hardware, ENV)
    job = Job.from_settings(planned)
    assert not fits(shape, params, job, memory)
    offloaded = offloaded_bf16(proposals(shape, params, job, memory, planned, HOST))
    assert [(o["num_devices"], o["overlay"]["parallel"]) for o in offloaded] == [
        (1, {"strategy": "fsdp", "cpu_offload": True})
    ]
    assert offloaded_bf16(proposals(shape, params, job, memory, planned, 48 * 2**30)) == []  # under the base's size
    assert offloaded_bf16(proposals(shape, params, job, memory, planned)) == []  # no host memory known


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="docs/training.md's table is the current stack's")
def test_training_docs_method_table_is_the_planners_output(monkeypatch):
    from moeflow.plan import counts
    from moeflow.workflow.method_table import method_table

    monkeypatch.setattr(counts, "meta_count", lambda config, shape: None)  # the closed form, as the doc says
    doc = (REPO_ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    table = doc.split("<!-- method-table:start -->\n")[1].split("<!-- method-table:end -->")[0]
    assert table == method_table()


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="docs/training.md's table is the current stack's")
def test_training_docs_target_table_is_the_planners_output_and_the_rows_that_fit_keep_fitting(monkeypatch):
    """#38's target rows (moeflow.workflow.method_table.TARGETS): the table in docs/training.md is the planner's, and
    a row that fits today (LoRA of Qwen3-30B-A3B on 2 x 80 GiB, QLoRA of GPT-OSS-20B on one 24 GiB card, LoRA of
    Step-3.5-Flash on 8 x 80 GiB under ep, QLoRA of Step-3.5-Flash on 8 x 24 GiB with CPU offload) fails this test the
    day it stops fitting."""
    from moeflow.plan import counts
    from moeflow.workflow.method_table import TARGETS, target_plan, target_table

    monkeypatch.setattr(counts, "meta_count", lambda config, shape: None)
    doc = (REPO_ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    table = doc.split("<!-- target-table:start -->\n")[1].split("<!-- target-table:end -->")[0]
    assert table == target_table()
    fitting = {(t.model, t.method, t.devices, t.gib): target_plan(t)["verdict"] for t in TARGETS}
    assert fitting[("qwen3-30b-a3b", "lora", 2, 80)] == "fits"
    assert fitting[("gpt-oss-20b", "qlora", 1, 24)] == "fits"
    assert fitting[("step3p5-flash", "lora", 8, 80)] == "fits"  # under ep: each rank's experts, never gathered
    assert fitting[("step3p5-flash", "lora", 8, 80)] != "does_not_fit"
    # a quantized base's fused experts dense one at a time (moeflow.model.quantized_experts): with the states on the
    # host, each 24 GiB card holds one layer of Step-3.5-Flash's QLoRA (whole dequantized experts: 24.9 GiB)
    step_8x24 = next(t for t in TARGETS if (t.model, t.method, t.devices, t.gib) == ("step3p5-flash", "qlora", 8, 24))
    assert target_plan(step_8x24, cpu_offload=True)["verdict"] == "fits"
