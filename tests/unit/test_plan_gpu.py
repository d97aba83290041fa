"""What a GPU really holds, per term and per phase, and a node's host: the planner against arithmetic done by hand.

The shapes are those of config/models/qwen3-30b-a3b.yaml and config/models/step3p5-flash.yaml, written
out here. Qwen3-30B-A3B is planned as its file gives it: FSDP over 8 x 80 GB, bf16 (FSDP mixed precision:
bf16 gathered parameters, fp32 sharded masters, fp32 gradient reduce-scatter), micro-batch 1 x 4096
tokens (the same 4096 tokens as 2 x 2048), gradient checkpointing, sdpa attention. The sum of the terms
is the planner's (conservative) peak.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import active_stack

from moeflow.families import registry
from moeflow.plan.counts import count_parameters
from moeflow.plan.fit import device_memory, verdict
from moeflow.plan.memory import (
    CPU_RANK_RUNTIME_BYTES,
    PHASES,
    Job,
    PlanMemoryStage,
    host_per_node_bytes,
    memory_per_device,
    phase_memory,
    root_unit_parameters,
)
from moeflow.plan.report import enforce, render_markdown, summary
from moeflow.plan.shapes import PlanError
from moeflow.plan.training_plan import plan
from moeflow.runtime import compat, env
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.scaleout import profile_request

GIB = 2**30
MODELS = REPO_ROOT / "config" / "models"
QWEN3_30B = MODELS / "qwen3-30b-a3b.yaml"
STEP3P5 = MODELS / "step3p5-flash.yaml"
MULTINODE = REPO_ROOT / "profiles" / "slurm-multinode" / "moeflow.yaml"

# Qwen3-30B-A3B: hidden 2048, 48 layers (all MoE), 32 query / 4 KV heads of 128, 128 experts of width 768,
# top-8, vocabulary 151,936, embedding and LM head untied.
QWEN_TOTAL = 30_532_122_624
QWEN_LAYER = (
    2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128  # q, k, v, o, q/k norms
    + 2 * 2048  # the two RMSNorms
    + 128 * 2048  # router
    + 128 * 3 * 2048 * 768  # routed experts: gate, up, down
)  # fmt: skip
QWEN_ROOT = 2 * 151_936 * 2048 + 2048  # embedding, LM head, final norm
QWEN_TOKENS = 1 * 4096
# The largest parameter: the embedding (and LM head), or on transformers 5 a layer's fused experts' gate_up
QWEN_LARGEST = max(151_936 * 2048, 128 * 2 * 768 * 2048 if registry.experts_fused("qwen3_moe") else 0)


def settings_of(*overlays, overrides=None) -> dict:
    return typed(PlanMemoryStage, plan_settings(run_config(load(*overlays, overrides=overrides), "moe")))


@pytest.fixture(scope="module", autouse=True)
def formula_counts():
    """Count with the closed form: building Qwen3-30B-A3B's 6,144 experts on the meta device takes ~40 s on
    this machine, and tests/unit/test_plan.py checks the formula against the meta count for every family."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("moeflow.plan.counts.meta_count", lambda config, shape: None)
        yield


@pytest.fixture(scope="module")
def env_report():
    return env.collect(active_stack(), REPO_ROOT / "envs" / f"{active_stack()}.yaml")


@pytest.fixture(scope="module")
def qwen():
    settings = settings_of(QWEN3_30B)
    shape, count, _ = count_parameters(settings.model, settings.vocab_size)
    return shape, count, Job.from_settings(settings)


def qwen_activation_bytes(tokens: int) -> int:
    """The recomputed layer's kept tensors per token, less its input (in the residual stream), plus the final norm."""
    attention = 2 * 2048 + (32 + 2 * 4) * 128 + 32 * 128 + 32  # input + norm out, q/k/v, attention out, softmax stats
    ffn_norm = 2 * 2048
    moe = 2 * 128 + 8 * (2 * 2048 + 3 * 768)  # router scores; each token into and out of 8 experts
    return tokens * (attention + ffn_norm + moe - 2048 + 2 * 2048) * 2


def test_qwen3_30b_a3b_terms_on_8_x_80gb_by_hand(qwen):
    shape, count, job = qwen
    assert (count.total, count.largest_layer, root_unit_parameters(shape, count)) == (
        QWEN_TOTAL,
        QWEN_LAYER,
        QWEN_ROOT,
    )
    assert job.num_devices == 8 and job.precision == "bf16" and job.mixed_precision
    assert (job.micro_batch_size, job.seq_len, job.gradient_checkpointing) == (1, 4096, True)
    mem = memory_per_device(shape, count, job)
    expected = {
        # fp32 masters 4 + fp32 gradients 4 + AdamW moments 8 = 16 bytes per parameter, over 8 devices
        "weights": QWEN_TOTAL * 2 // 8,
        "gradients": QWEN_TOTAL * 2 // 8,
        "optimizer": QWEN_TOTAL * 12 // 8,
        "unsharded_layer": QWEN_LAYER * (2 + 2),  # the running layer in bf16 and its bf16 gradient
        "prefetched_layer": QWEN_LAYER * 2,  # the next layer's bf16 all-gather
        "layer_gradient_reduce": QWEN_LAYER * 4,  # the gradient's fp32 reduce-scatter buffer
        "root_unit": QWEN_ROOT * (2 + 2),  # embedding + LM head + norm in bf16, and their bf16 gradient
        "residual_stream": QWEN_TOKENS * 48 * 2048 * 2,  # one bf16 layer input per layer (checkpointing)
        "activations": qwen_activation_bytes(QWEN_TOKENS),
        # sdpa: one [1, 1, 4096, 4096] mask (full attention only): transformers 5's booleans, or on 4.57 moeflow's
        # additive float32 mask
        "attention_masks": QWEN_TOKENS * 4096 * (1 if compat.is_transformers_v5() else 4),
        # the chunked loss: 1024 tokens' fp32 logits and their bf16 product/gradient copy; kept in fp32 from the
        # forward to the backward pass: the hidden states' gradient, the token losses, the LM head's gradient
        "loss": 1024 * 151_936 * (4 + 2) + (QWEN_TOKENS * (2048 + 1) + 151_936 * 2048) * 4,
        "runtime": 1 * GIB,  # CUDA context
    }
    assert {k: v for k, v in mem.items() if k != "total"} == expected
    assert mem["total"] == sum(expected.values())
    assert expected["root_unit"] / GIB == pytest.approx(2.32, abs=0.01)
    # the full logits' loss took 14 bytes per token and entry, 8.11 GiB; the chunked one 2.06 GiB in all
    assert expected["loss"] / GIB == pytest.approx(2.06, abs=0.01)
    assert 68 * GIB <= mem["total"] <= 71 * GIB  # 69.34 GiB (75.41 with the full logits: tight)
    visible = int(79.11 * GIB)  # an 80 GB H100 as torch sees it
    assert verdict(mem["total"], visible) == "fits"  # under 90% of the card


def test_qwen3_30b_a3b_does_not_fit_when_a_term_pushes_it_over(qwen):
    shape, count, job = qwen
    visible = int(79.11 * GIB)
    one = memory_per_device(shape, count, job)
    two = memory_per_device(shape, count, dataclasses.replace(job, micro_batch_size=2))
    # micro-batch 2: 8192 tokens; the loss grows by the kept per-token gradients only (the full logits grew by
    # 4096 x 151,936 x 14 bytes, 8.11 GiB, which made it not fit)
    assert two["loss"] - one["loss"] == 4096 * (2048 + 1) * 4 and two["activations"] == qwen_activation_bytes(8192)
    assert two["residual_stream"] == 8192 * 48 * 2048 * 2
    assert verdict(two["total"], visible) == "fits"
    # the chunk size is the planner's too: micro-batch 4 in one chunk of 16,384 tokens holds 13.9 GiB of logits
    whole = memory_per_device(shape, count, dataclasses.replace(job, micro_batch_size=4, loss_chunk_tokens=16384))
    assert whole["loss"] == 16384 * 151_936 * 6 + (16384 * 2049 + 151_936 * 2048) * 4
    assert whole["total"] - whole["loss"] < visible < whole["total"]  # the logits push it over the card
    assert verdict(whole["total"], visible) == "does_not_fit"
    # seven cards: the states grow to 16 x N / 7; the per-layer FSDP terms and the root unit stay
    seven = memory_per_device(shape, count, dataclasses.replace(job, num_devices=7))
    assert seven["optimizer"] == -(-QWEN_TOTAL * 12 // 7) and seven["root_unit"] == QWEN_ROOT * 4
    assert verdict(seven["total"], visible) == "tight"
    six = memory_per_device(shape, count, dataclasses.replace(job, num_devices=6))
    assert verdict(six["total"], visible) == "does_not_fit"
    # one card: nothing is gathered, and the residual stream is fp32 (bf16 autocast over fp32 weights)
    one = memory_per_device(shape, count, dataclasses.replace(job, num_devices=1))
    assert one["prefetched_layer"] == one["layer_gradient_reduce"] == one["root_unit"] == 0
    assert one["residual_stream"] == QWEN_TOKENS * 48 * 2048 * 4


def test_an_80gb_card_is_planned_with_what_torch_sees_of_it(env_report):
    result = plan(settings_of(QWEN3_30B), env_report)
    assert result["device_memory_bytes"] == int(79.11 * GIB) and "79.11 GiB visible" in result["device_memory_source"]
    assert result["verdict"] == "fits" and 68 <= result["per_device_gib"]["total"] <= 71
    other = plan(settings_of(QWEN3_30B, overrides={"hardware": {"memory_gib_per_device": 96}}), env_report)
    assert other["device_memory_bytes"] == 96 * GIB  # not a size the table knows: taken as torch's total
    cpu = settings_of(QWEN3_30B, overrides={"hardware": {"device": "cpu", "memory_gib_per_device": 80}})
    assert device_memory(cpu.hardware, env_report)[0] == 80 * GIB


def test_new_terms_are_in_the_plan_files(env_report):
    result = plan(settings_of(QWEN3_30B), env_report)
    for key in ("prefetched_layer", "layer_gradient_reduce", "root_unit", "residual_stream", "loss"):
        assert key in result["per_device_bytes"] and key in result["per_device_gib"]
    text, markdown = summary(result), render_markdown(result)
    gib = result["per_device_gib"]
    assert f"root unit {gib['root_unit']:.2f} GiB" in text and f"loss {gib['loss']:.2f} GiB" in text
    assert "| prefetched layer |" in markdown and "| layer gradient reduce |" in markdown
    assert "## Memory per rank and phase (worst: step)" in markdown and "| device: gathered tensor |" in markdown
    assert "## Host memory per node by phase (8 rank(s); worst: export)" in markdown
    assert "host per node, worst phase export:" in text and "worst phase step:" in text


def test_qwen3_30b_a3b_phases_by_hand(qwen):
    """Every phase per rank of FSDP over 8 GPUs: the resident state is fp32 parameters (4 bytes) and AdamW's two
    fp32 moments (8 bytes), over the 8 ranks; the host holds one tensor's buffer and the runtime."""
    shape, count, job = qwen
    assert job.strategy == "fsdp" and job.shard_ranks == 8 and job.ranks_per_node == 8
    phases = phase_memory(shape, count, job)
    weights, moments = QWEN_TOTAL * 4 // 8, QWEN_TOTAL * 8 // 8
    owned, whole = -(-QWEN_LARGEST * 4 // 8), QWEN_LARGEST * 4
    wrapping = (
        max(QWEN_LAYER, QWEN_ROOT) * 4 if not compat.fsdp2_available() else 0
    )  # FSDP1 materialises a unit to wrap it
    host = 3 * GIB  # interpreter, torch, CUDA's host libraries
    expected = {
        "load": (
            {"weights": weights, "wrapping_unit": wrapping, "runtime": GIB},
            {"read_buffer": owned, "runtime": host},
        ),
        "checkpoint": (
            {"weights": weights, "optimizer": moments, "runtime": GIB},
            {"staging_copy": owned, "runtime": host},
        ),
        # a fresh AdamW's state is initialised by a step on zero gradients (bf16 shards: fp32, 4 bytes) first
        "resume": (
            {"weights": weights, "optimizer": moments, "initial_gradients": QWEN_TOTAL * 4 // 8, "runtime": GIB},
            {"read_buffer": owned, "runtime": host},
        ),
        "export": (
            {"weights": weights, "optimizer": moments, "gathered_tensor": whole, "runtime": GIB},
            {"staging_copy": whole, "runtime": host},
        ),
    }
    for phase, (device, host_side) in expected.items():
        assert phases[phase]["device"] == device | {"total": sum(device.values())}, phase
        assert phases[phase]["host"] == host_side | {"total": sum(host_side.values())}, phase
    step = memory_per_device(shape, count, job)
    assert phases["step"]["device"] == step and phases["step"]["host"] == {"runtime": host, "total": host}
    # 14.22 GiB of fp32 weights and 28.43 GiB of moments per GPU between steps; the step's 69.3 GiB is the worst
    assert phases["checkpoint"]["device"]["total"] / GIB == pytest.approx(43.65, abs=0.01)
    assert max(PHASES, key=lambda name: phases[name]["device"]["total"]) == "step"
    # strategy none on the same 8 GPUs: every rank whole in every phase
    whole_model = phase_memory(shape, count, dataclasses.replace(job, replicated=True))
    for phase in ("load", "checkpoint", "resume", "export"):
        assert whole_model[phase]["device"]["weights"] == QWEN_TOTAL * 4, phase
    assert whole_model["export"]["device"]["optimizer"] == QWEN_TOTAL * 8
    assert whole_model["load"]["device"]["wrapping_unit"] == 0 and whole_model["load"]["host"]["read_buffer"] == whole


def test_lora_holds_its_frozen_base_in_bf16_in_every_phase(qwen, env_report):
    """LoRA with strategy none (what moeflow runs on several ranks) under bf16: the frozen base is loaded and held
    in bf16 in every phase (moeflow.loading.factory.Layout.weights_dtype), the adapters in fp32 with their AdamW
    moments. It was planned (and held) in fp32 between steps, 4 x 30.5B = 113.7 GiB, so that the checkpoint of a
    job whose step fitted did not (#38); on a 96 GiB card every phase now fits."""
    settings = settings_of(
        QWEN3_30B,
        overrides={
            "train": {"method": "lora"},
            "parallel": {"strategy": "none"},
            "hardware": {"memory_gib_per_device": 96},
        },
    )
    result = plan(settings, env_report)
    phases, adapters = result["phases"], result["lora"]
    checkpoint = QWEN_TOTAL * 2 + adapters["trainable"] * 4 + adapters["trainable"] * 8 + GIB
    assert phases["checkpoint"]["device_bytes"]["total"] == checkpoint
    assert phases["load"]["device_bytes"]["weights"] == QWEN_TOTAL * 2 + adapters["trainable"] * 4
    assert result["verdict"] == "fits" and all(phase["verdict"] == "fits" for phase in phases.values())
    enforce(result)


# --------------------------------------------------------------------------- Step-3.5-Flash

# hidden 4096, 45 layers (0-2 dense of width 11,264, 3-44 MoE), 8 KV heads of 128 and 64 query heads on the 12
# full-attention layers (0, 4, ..., 44), 96 on the 33 sliding-window ones, a sigmoid gate per query head, 288
# experts of width 1280, top-8, one shared expert of width 1280, vocabulary 128,896, untied; 3 MTP layers
# (sliding, dense: the decoder layer, enorm, hnorm, eh_proj 8192 x 4096, the shared head's norm and output layer).
STEP_TRAINED = 196_956_118_272  # all but the MTP layers


def step_attention(heads: int) -> int:
    return 4096 * heads * 128 + 2 * 4096 * 1024 + heads * 128 * 4096 + 2 * 128 + 4096 * heads  # q k v o norms gate


STEP_DENSE_LAYER = step_attention(96) + 2 * 4096 + 3 * 4096 * 11264  # layers 1 and 2 (layer 0 has 64 heads)
STEP_MOE_LAYER_WITHOUT_ROUTED = step_attention(96) + 2 * 4096 + 3 * 4096 * 1280 + 288 * 4096  # + shared, router
STEP_ROUTED = 288 * 3 * 4096 * 1280  # one layer's routed experts
STEP_MTP = 3 * (STEP_DENSE_LAYER + 2 * 4096 + 8192 * 4096 + 4096 + 128_896 * 4096)
STEP_TOTAL = STEP_TRAINED + STEP_MTP
STEP_ROOT = 2 * 128_896 * 4096 + 4096
STEP_TOKENS = 2 * 2048


def step_loss_bytes(tokens: int) -> int:
    """A 1024-token chunk of bf16 logits (fp32 copy + bf16 product), the kept fp32 gradients and token losses."""
    return 1024 * 128_896 * 6 + (tokens * (4096 + 1) + 128_896 * 4096) * 4


def step_activation_bytes(tokens: int) -> int:
    attention = 2 * 4096 + (96 + 2 * 8) * 128 + 96 * 128 + 96 + 96  # ... softmax stats, head gates (96 heads)
    moe = 2 * 288 + 8 * (2 * 4096 + 3 * 1280) + 3 * 1280 + 4096  # router, 8 experts, the shared expert
    return tokens * (attention + 2 * 4096 + moe - 4096 + 2 * 4096) * 2  # the MoE layer is the largest


@pytest.fixture(scope="module")
def step():
    settings = settings_of(STEP3P5)
    shape, count, _ = count_parameters(settings.model, settings.vocab_size)
    return shape, count, Job.from_settings(settings)


def test_step3p5_flash_on_its_24gb_card_by_hand(step, env_report):
    shape, count, job = step
    assert (count.total, count.without_mtp) == (STEP_TOTAL, STEP_TRAINED)
    assert (job.num_devices, job.micro_batch_size, job.seq_len) == (1, 2, 2048)
    mem = memory_per_device(shape, count, job)
    assert mem["unsharded_layer"] == mem["prefetched_layer"] == mem["layer_gradient_reduce"] == mem["root_unit"] == 0
    assert mem["residual_stream"] == STEP_TOKENS * 45 * 4096 * 4  # fp32 on one card (autocast)
    assert mem["activations"] == step_activation_bytes(STEP_TOKENS)
    assert mem["loss"] == step_loss_bytes(STEP_TOKENS)
    # bf16 weights of everything; bf16 gradients, AdamW's moments and fp32 masters of all but the frozen MTP layers
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == 2 * STEP_TOTAL + 14 * STEP_TRAINED
    result = plan(settings_of(STEP3P5), env_report)
    assert result["device_memory_bytes"] == int(23.68 * GIB) and result["verdict"] == "does_not_fit"


def test_step3p5_flash_on_the_multinode_profile_by_hand(step, env_report):
    """48 x 80 GB in 6 nodes of 8, the profile's expert parallelism (EP 8: each rank runs 36 of a layer's 288
    experts, FSDP-sharded over the 6 ranks that hold the same ones, so gathered over those with the layer's
    dense part), and the root unit (1.06B parameters). The MTP layers never run: never gathered."""
    shape, count, job = step
    assert count.largest_layer_without_routed == max(STEP_DENSE_LAYER, STEP_MOE_LAYER_WITHOUT_ROUTED)
    assert count.largest_layer_without_routed == STEP_DENSE_LAYER
    assert (count.moe_layer_without_routed, count.largest_layer_routed) == (STEP_MOE_LAYER_WITHOUT_ROUTED, STEP_ROUTED)
    cluster = typed(PlanMemoryStage, plan_settings(run_config(load(STEP3P5, MULTINODE), "moe")))
    ep = Job.from_settings(cluster)
    assert (ep.num_devices, ep.ep_size, ep.shard_ranks, ep.ranks_per_node, ep.expert_parallel) == (48, 8, 48, 8, True)
    mem = memory_per_device(shape, count, ep)
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == -(-2 * STEP_TOTAL // 48) + 14 * STEP_TRAINED // 48
    unit = STEP_MOE_LAYER_WITHOUT_ROUTED + STEP_ROUTED // 8  # larger than the dense layers
    assert unit > STEP_DENSE_LAYER
    assert mem["unsharded_layer"] == unit * 4 and mem["prefetched_layer"] == unit * 2
    assert mem["layer_gradient_reduce"] == unit * 4 and mem["root_unit"] == STEP_ROOT * 4
    # with EP over all 48 ranks each rank holds its 6 experts alone: only the dense part is gathered
    alone = memory_per_device(shape, count, dataclasses.replace(ep, ep_size=48))
    assert alone["unsharded_layer"] == STEP_DENSE_LAYER * 4
    assert mem["residual_stream"] == STEP_TOKENS * 45 * 4096 * 2  # bf16 under FSDP mixed precision
    assert mem["activations"] == step_activation_bytes(STEP_TOKENS) and mem["loss"] == step_loss_bytes(STEP_TOKENS)
    visible = int(79.11 * GIB)
    assert verdict(mem["total"], visible) == "tight"
    five_nodes = memory_per_device(shape, count, dataclasses.replace(ep, num_devices=40))
    assert verdict(five_nodes["total"], visible) == "does_not_fit"
    # the load phase: each rank allocates only its share (fp32); its host reads one tensor's owned rows at a time
    phases = phase_memory(shape, count, ep)
    largest = 128_896 * 4096  # the embedding (transformers 5 fuses the experts: 288 x 2560 x 4096 is larger)
    largest = max(largest, 288 * 2 * 1280 * 4096 if registry.experts_fused("step3p5") else 0)
    assert phases["load"]["device"] == {
        "weights": -(-STEP_TOTAL * 4 // 48),
        "wrapping_unit": 0,  # transformers 5 shards at load
        "runtime": GIB,
        "total": -(-STEP_TOTAL * 4 // 48) + GIB,
    }
    assert phases["export"]["device"]["gathered_tensor"] == 4 * largest
    per_node = host_per_node_bytes(phases["export"], ep)
    assert per_node == 8 * (4 * largest + 3 * GIB)
    mem_mb = profile_request("slurm-multinode").mem_mb
    assert verdict(per_node, mem_mb * 2**20) == "fits"


# --------------------------------------------------------------------------- a node's host memory


def test_qwen3_30b_a3b_ranks_load_their_shards_within_the_nodes_memory(qwen, env_report, caplog):
    """Each rank reads only its shard: the node's host holds 8 x (one tensor's buffer + 3 GiB of runtime), not
    8 x the fp32 model (933.9 GiB, tight in the profile's 937.5 GiB, before sharded loading)."""
    _, count, job = qwen
    mem_mb = profile_request("slurm").mem_mb
    assert mem_mb == 960_000  # 937.5 GiB
    result = plan(settings_of(QWEN3_30B), env_report, mem_mb=mem_mb)
    host = result["host"]
    # the worst: the export stages one whole gathered tensor on the host of every rank
    assert host["phase"] == "export" and host["per_node_bytes"]["export"] == 8 * (QWEN_LARGEST * 4 + 3 * GIB)
    assert host["per_node_bytes"]["load"] == 8 * (-(-QWEN_LARGEST * 4 // 8) + 3 * GIB)
    assert host["verdict"] == "fits" and host["limit_bytes"] == mem_mb * 2**20
    assert host["limit_source"] == "the training job's mem_mb"
    with caplog.at_level("WARNING", logger="moeflow.plan"):
        enforce(result)
    assert not caplog.text
    short = plan(settings_of(QWEN3_30B), env_report, mem_mb=30_000)  # 29.3 GiB < 8 x 4.16 GiB
    assert short["host"]["verdict"] == "does_not_fit"
    with pytest.raises(PlanError, match="8 rank\\(s\\) per node do not fit in the host memory of 29.30 GiB .*export"):
        enforce(short)
    # without mem_mb the host is compared with this machine's RAM, and only warned about (GPU ranks run elsewhere)
    here = plan(settings_of(QWEN3_30B), env_report)
    assert here["host"]["limit_bytes"] == env_report["system"]["ram_usable_bytes"]
    enforce(here)


def test_the_embedded_default_fits_within_this_machine(env_report):
    result = plan(settings_of(), env_report)
    runtime = CPU_RANK_RUNTIME_BYTES[compat.transformers_major()]
    count = result["parameters"]["total"]
    load = result["phases"]["load"]
    assert load["device_bytes"] == {
        "weights": 4 * count,
        "wrapping_unit": 0,
        "runtime": runtime,
        "total": 4 * count + runtime,
    }
    assert result["host"]["per_node_bytes"] == {name: phase["rank_bytes"] for name, phase in result["phases"].items()}
    assert result["host"]["verdict"] == "fits" and result["verdict"] == "fits"
