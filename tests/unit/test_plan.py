"""The memory planner: parameter counts from config (checked against transformers), memory, verdicts."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import active_stack
from tiny_models import TRANSFORMERS_5_ONLY

from moeflow.families.registry import experts_fused
from moeflow.loading.factory import make_model
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.plan.activations import attention_mask_bytes
from moeflow.plan.counts import count_parameters, formula_count, lora_count
from moeflow.plan.fit import min_devices, verdict
from moeflow.plan.memory import (
    CPU_RANK_RUNTIME_BYTES,
    GIB,
    PHASES,
    Job,
    PlanMemoryStage,
    host_per_node_bytes,
    memory_per_device,
    phase_memory,
    rank_bytes,
)
from moeflow.plan.report import enforce, render_markdown, summary
from moeflow.plan.shapes import PlanError, model_shape, resolve_vocab_size
from moeflow.plan.training_plan import plan
from moeflow.runtime import compat, env
from moeflow.runtime.files import dumps_json
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.settings import LoraSettings
from moeflow.workflow.keys import plan_settings
from moeflow.workflow.load import load, run_config

V5_ONLY = pytest.mark.skipif(not compat.is_transformers_v5(), reason="step3p5 exists in transformers 5 only")
STEP3P5 = REPO_ROOT / "config" / "models" / "step3p5-flash.yaml"
QWEN3_30B = REPO_ROOT / "config" / "models" / "qwen3-30b-a3b.yaml"
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
}
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 2, "topk_group": 1}
FAMILY_CONFIGS = {
    "qwen3_moe": {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    },
    "qwen3_moe-tied-sparse-step": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": True,
    },
    "qwen2_moe": {
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 48,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "num_nextn_predict_layers": 1,  # an MTP layer (MoE, its own embedding and head), as published
        **MLA,
    },
    "deepseek_v3-no-q-lora": {
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "first_k_dense_replace": 2,
        "q_lora_rank": None,
        "num_nextn_predict_layers": 0,  # transformers 5 defaults to 1, 4.57 has no such key
        **MLA,
    },
    "gpt_oss": {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
    },
    # the published model's shape features: other head counts on sliding layers, a dense first layer, 2 MTP
    # layers (one sliding and dense, one full and MoE) whose types follow the main layers' in the lists
    "step3p5": {
        "head_dim": 16,
        "num_sliding_attention_heads": 6,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "share_expert_dim": 24,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
        + ["full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
        "num_nextn_predict_layers": 2,
        "tie_word_embeddings": False,
    },
}
FAMILY_NAMES = [pytest.param(n, marks=[V5_ONLY] if n in TRANSFORMERS_5_ONLY else []) for n in sorted(FAMILY_CONFIGS)]


@pytest.fixture(scope="module")
def env_report():
    return env.collect(active_stack(), REPO_ROOT / "envs" / f"{active_stack()}.yaml")


def model_section(name: str) -> dict:
    fields = {"model_type": name, **SMALL, **FAMILY_CONFIGS[name]}
    return {"config": fields, "attn_implementation": "eager", "experts_implementation": STACK_DEFAULT_EXPERTS}


def settings_of(*overlays, overrides=None) -> dict:
    return typed(PlanMemoryStage, plan_settings(run_config(load(*overlays, overrides=overrides), "moe")))


# --------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_formula_matches_the_meta_device_count(name):
    shape, exact, formula = count_parameters(model_section(name), tokenizer_vocab=300)
    assert exact.method == "meta"
    assert formula.by_category == exact.by_category
    assert (formula.largest_layer, formula.largest_layer_without_routed) == (
        exact.largest_layer,
        exact.largest_layer_without_routed,
    )
    assert formula.active == exact.active < exact.total
    assert formula.largest_tensor == exact.largest_tensor  # the export's one whole gathered tensor
    assert formula.largest_layer_routed == exact.largest_layer_routed
    assert formula.moe_layer_without_routed == exact.moe_layer_without_routed
    assert formula.hidden_matrices == exact.hidden_matrices > 0  # Muon's matrices (train.optimizer: muon)
    assert exact.by_category["routed_experts"] > 0 and exact.by_category["router"] > 0


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss", pytest.param("step3p5", marks=V5_ONLY)])
def test_meta_count_matches_a_real_model(name):
    section = model_section(name)
    _, exact, _ = count_parameters(section, tokenizer_vocab=300)
    model = make_model(typed(ModelSettings, section), vocab_size=300)
    assert exact.total == sum(p.numel() for p in model.parameters())


def test_the_kept_meta_count_is_not_changed_by_a_caller():
    """moeflow.plan.counts keeps each model's meta count for the process: a caller's change to its counts must not
    reach the next caller."""
    _, first, _ = count_parameters(model_section("qwen3_moe"), tokenizer_vocab=300)
    assert first.method == "meta"
    total = first.total
    first.by_category["routed_experts"] = 0
    _, again, _ = count_parameters(model_section("qwen3_moe"), tokenizer_vocab=300)
    assert again.total == total and again is not first


def test_shared_experts_and_dense_first_layers_are_counted():
    shape, _, formula = count_parameters(model_section("deepseek_v3"), tokenizer_vocab=300)
    assert shape.dense_layers == (0,) and shape.moe_layers == (1, 2)
    assert formula.by_category["dense_ffn"] == 3 * 64 * 96
    assert formula.by_category["shared_experts"] == 2 * 3 * 64 * 32
    # active: everything but the routed experts and the MTP layer, plus top_k / num_experts of the routed experts
    routed, mtp = formula.by_category["routed_experts"], formula.by_category["mtp"]
    assert mtp > 2 * 300 * 64  # its embedding and output layer
    assert formula.active == formula.total - mtp - routed + routed * 2 // 8


def test_tied_embeddings_are_counted_once():
    _, tied, _ = count_parameters(model_section("qwen3_moe-tied-sparse-step"), tokenizer_vocab=300)
    assert tied.by_category["lm_head"] == 0 and tied.by_category["embedding"] == 300 * 64


def test_step3p5_flash_counts_the_published_shape():
    """196.96B parameters in the model with 96 query heads on its 33 sliding-window layers (195.84B if they had
    the full layers' 64), plus 2.43B in its 3 MTP layers; on transformers 5 counted on the meta device
    (moeflow.families.step3p5), the closed form agreeing on both stacks."""
    settings = settings_of(STEP3P5)
    shape, counted, formula = count_parameters(settings.model, settings.vocab_size)
    assert counted.method == ("meta" if compat.is_transformers_v5() else "formula")
    assert shape.vocab_size == 128_896 and len(shape.moe_layers) == 42 and shape.dense_layers == (0, 1, 2)
    assert (shape.num_experts, shape.top_k, shape.expert_ffn, shape.shared_ffn) == (288, 8, 1280, 1280)
    assert sorted(set(shape.layer_heads)) == [64, 96] and shape.layer_heads.count(96) == 33
    assert shape.mtp_heads == (96, 96, 96) and shape.mtp_moe == (False, False, False)
    assert counted.without_mtp == 196_956_118_272 and counted.by_category["mtp"] == 2_428_171_008
    assert formula.by_category == counted.by_category
    # StepFun's "11B active" is without the embedding and the LM head (10.93B; 11.99B with them)
    assert counted.active - counted.embeddings == pytest.approx(11e9, rel=0.01)
    sixty_four = {**settings.model, "config": {**settings.model["config"], "num_sliding_attention_heads": 64}}
    assert count_parameters(sixty_four)[1].without_mtp == 195_844_496_640


def test_qwen3_30b_a3b_counts_like_the_published_model():
    settings = settings_of(QWEN3_30B)
    shape = model_shape(dict(settings.model["config"]), 151_936)
    count = formula_count(shape)
    assert count.total == pytest.approx(30.5e9, rel=0.01) and count.active == pytest.approx(3.3e9, rel=0.03)
    job = Job.from_settings(settings)
    visible = int(79.11 * GIB)  # an 80 GB H100 as torch sees it; test_plan_gpu.py has the terms by hand
    assert verdict(memory_per_device(shape, count, job)["total"], visible) == "fits"
    one = dataclasses.replace(job, num_devices=1)
    assert verdict(memory_per_device(shape, count, one)["total"], visible) == "does_not_fit"


def test_model_config_vocab_size_is_preferred_to_the_tokenizer():
    assert resolve_vocab_size({"vocab_size": 128_896}, 4096) == 128_896
    assert resolve_vocab_size({}, 4096) == 4096
    with pytest.raises(PlanError, match="vocab_size"):
        resolve_vocab_size({}, None)


def test_unknown_family_and_missing_key_name_the_key():
    with pytest.raises(PlanError, match=r"model\.config\.model_type.*qwen3_moe"):
        model_shape({"model_type": "llama"}, 100)
    fields = {"model_type": "step3p5", **SMALL, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
    with pytest.raises(PlanError, match=r"model\.config\.n_routed_experts.*moe_num_experts"):
        model_shape(fields, 100)


# --------------------------------------------------------------------------- memory and verdicts


def tiny_shape_and_count():
    shape, exact, _ = count_parameters(model_section("qwen3_moe"), tokenizer_vocab=300)
    return shape, exact


def default_job(**changes) -> Job:
    """The embedded default's job, with ``changes``."""
    return dataclasses.replace(Job.from_settings(settings_of()), **changes)


def lora_of(**section) -> LoraSettings:
    return typed(LoraSettings, section)


def test_states_take_16_bytes_per_parameter_in_both_precisions():
    shape, count = tiny_shape_and_count()
    for precision in ("fp32", "bf16"):
        mem = memory_per_device(shape, count, default_job(precision=precision))
        assert mem["weights"] + mem["gradients"] + mem["optimizer"] == 16 * count.total
    bf16 = memory_per_device(shape, count, default_job(precision="bf16"))
    assert bf16["weights"] == 2 * count.total and bf16["optimizer"] == 12 * count.total


def test_a_quantized_base_is_counted_as_it_loads_and_runs():
    """QLoRA's load reads each weight's rows dense 64 MiB at a time and packs them (moeflow.parallel.rank_load), and a
    smaller model's tensors whole, in less; its step holds a layer's attention and MLP matrices dense, and its fused
    experts one expert's matrix at a time (moeflow.model.quantized_experts), not the layer's whole experts."""
    shape, count = tiny_shape_and_count()
    lora = default_job(method="lora", precision="bf16", gradient_checkpointing=True)
    qlora = dataclasses.replace(lora, quantization="nf4")
    load = phase_memory(shape, count, qlora)["load"]["device"]
    # dense bf16 rows and their NF4 bytes: at most a layer's on a tiny model, 64 MiB on Qwen3-30B-A3B
    assert load["quantized_read"] == math.ceil(count.largest_layer * 2 * (1 + 0.5625 / 2))
    big = Job.from_settings(settings_of(QWEN3_30B))
    big = dataclasses.replace(big, method="lora", precision="bf16", quantization="nf4", num_devices=1)
    big_shape = model_shape(dict(settings_of(QWEN3_30B).model["config"]), 151_936)
    big_load = phase_memory(big_shape, formula_count(big_shape), big)["load"]["device"]
    assert big_load["quantized_read"] == math.ceil(64 * 2**20 * (1 + 0.5625 / 2))
    assert "quantized_read" not in phase_memory(shape, count, lora)["load"]["device"]
    step = memory_per_device(shape, count, qlora)
    expert_matrix = 2 * shape.expert_ffn * shape.hidden_size
    fused = experts_fused(shape.model_type)
    dense = count.largest_layer_without_routed + expert_matrix if fused else count.largest_layer + count.largest_tensor
    assert step["dequantized_layer"] == 2 * dense
    if fused:
        assert step["dequantized_layer"] < 2 * count.largest_layer  # the layer's experts are never dense at once


def test_sharding_checkpointing_and_lora_lower_what_they_should():
    shape, count = tiny_shape_and_count()
    small = default_job(micro_batch_size=2, seq_len=256)
    base = memory_per_device(shape, count, small)
    four = memory_per_device(shape, count, dataclasses.replace(small, num_devices=4))
    assert four["optimizer"] == pytest.approx(base["optimizer"] / 4, abs=1)
    assert four["unsharded_layer"] == count.largest_layer * 8 and base["unsharded_layer"] == 0
    checkpointed = memory_per_device(shape, count, dataclasses.replace(small, gradient_checkpointing=True))
    assert checkpointed["activations"] < base["activations"]
    sdpa = memory_per_device(shape, count, dataclasses.replace(small, attn_implementation="sdpa"))
    eager = memory_per_device(shape, count, dataclasses.replace(small, attn_implementation="eager"))
    assert eager["activations"] - sdpa["activations"] == 2 * 256 * shape.num_layers * shape.num_heads * 256 * 4
    lora_job = dataclasses.replace(small, method="lora", lora=lora_of(rank=4))
    lora = memory_per_device(shape, count, lora_job)
    adapters = lora_count(shape, lora_job.lora)
    assert 0 < adapters.trainable < count.total / 2
    assert lora["weights"] == base["weights"] + 4 * adapters.added  # frozen base + the adapters
    assert lora["gradients"] == 4 * adapters.trainable and lora["optimizer"] == 8 * adapters.trainable


def test_min_devices_is_the_smallest_count_that_fits():
    settings = settings_of(STEP3P5)
    shape, count, _ = count_parameters(settings.model, settings.vocab_size)
    job = dataclasses.replace(Job.from_settings(settings), expert_parallel=True)
    memory = 24 * GIB
    n = min_devices(shape, count, job, memory)
    assert n and n > 100

    def fits(k):
        return verdict(memory_per_device(shape, count, dataclasses.replace(job, num_devices=k))["total"], memory)

    assert fits(n) == "fits" and fits(n - 1) != "fits"


def test_full_fine_tune_of_step3p5_flash_on_one_24gb_card_is_refused_with_the_numbers(env_report):
    result = plan(settings_of(STEP3P5), env_report)
    assert result["verdict"] == "does_not_fit"
    assert result["device_memory_bytes"] == int(23.68 * GIB)  # a 24 GB RTX 4090 as torch sees it
    assert result["per_device_bytes"]["total"] > 100 * 24 * GIB
    with pytest.raises(PlanError) as err:
        enforce(result)
    message = str(err.value)
    gib = result["per_device_gib"]
    assert "196.96B parameters (11.99B active per token) and 2.43B in MTP layers (carried frozen)" in message
    assert "1 x cuda of 23.7 GiB" in message and "does not fit" in message
    assert f"per device {gib['total']:.2f} GiB" in message and f"AdamW states {gib['optimizer']:.2f} GiB" in message
    assert "weights, gradients and AdamW states alone" in message
    # the proposals: sharded over many cards (expert parallelism on transformers 5 only), each in the message
    sharded = [o for o in result["suggestions"] if o["strategy"] in ("fsdp", "ep")]
    full = [o for o in sharded if "method" not in o["overlay"].get("train", {})]  # LoRA under ep needs fewer
    assert sharded == result["suggestions"] and all(o["num_devices"] > 100 for o in full)
    assert "ep" in {o["strategy"] for o in sharded} or not compat.is_transformers_v5()  # none fits without it
    assert all(f"{o['change']}: {o['num_devices']} device(s)" in message for o in sharded)


def test_the_embedded_default_fits_on_this_machine(env_report):
    result = plan(settings_of(), env_report)
    assert result["verdict"] == "fits"
    enforce(result)
    assert result["device_memory_bytes"] == env_report["system"]["ram_usable_bytes"]  # hardware.device: cpu
    assert result["parameters"]["method"] == "meta" and result["parameters"]["formula_matches"]
    assert dumps_json(plan(settings_of(), env_report)) == dumps_json(result)
    assert "fits" in render_markdown(result)


def test_cuda_without_a_gpu_or_a_memory_setting_says_what_to_set(env_report):
    if env_report["torch"]["gpus"]:
        pytest.skip("this machine has a GPU")
    settings = settings_of(overrides={"hardware": {"device": "cuda"}})
    with pytest.raises(PlanError, match="hardware.memory_gib_per_device"):
        plan(settings, env_report)


def test_a_tight_job_warns_and_goes_on(env_report, caplog):
    needed = plan(settings_of(), env_report)["per_device_bytes"]["total"]
    settings = settings_of(overrides={"hardware": {"memory_gib_per_device": needed / 0.95 / GIB}})
    result = plan(settings, env_report)
    assert result["verdict"] == "tight" and result["suggestions"]
    with caplog.at_level("WARNING", logger="moeflow.plan"):
        enforce(result)
    assert "less than 10% headroom" in caplog.text


# --------------------------------------------------------------------------- phases and layouts


def parallel_settings(parallel: dict, hardware: dict | None = None, **overrides) -> dict:
    """The embedded default in the layout ``parallel``, whose config check then refuses its LoRA run (LoRA runs on
    whole models only: dropped here) and, under expert parallelism, its tied embeddings (untied here)."""
    devices = parallel["nproc_per_node"] * parallel.get("nnodes", 1)
    untied = {"model": {"config": {"tie_word_embeddings": False}}} if parallel.get("strategy") == "ep" else {}
    return settings_of(
        overrides={
            "runs": {"lora": None},
            **untied,
            "parallel": parallel,
            "hardware": {"num_devices": devices, **(hardware or {})},
            **overrides,
        }
    )


def test_the_parallel_section_names_the_layout():
    ep = Job.from_settings(
        parallel_settings(
            {"nproc_per_node": 4, "nnodes": 2, "strategy": "ep", "ep_size": 4},
            {"device": "cuda", "memory_gib_per_device": 80},
        )
    )
    assert (
        ep.expert_parallel and ep.strategy == "ep" and (ep.num_devices, ep.ranks_per_node, ep.shard_ranks) == (8, 4, 8)
    )
    none = Job.from_settings(parallel_settings({"nproc_per_node": 2, "strategy": "none"}))
    assert none.replicated and none.strategy == "none" and none.shard_ranks == 1 and not none.sharded
    fsdp = Job.from_settings(parallel_settings({"nproc_per_node": 4, "strategy": "fsdp", "fsdp_size": 2}))
    assert fsdp.strategy == "fsdp" and fsdp.shard_ranks == 2 and fsdp.ranks_per_node == 4
    # no ranks in the parallel section, several devices: a plan on paper, FSDP over one node's devices
    paper = Job.from_settings(settings_of(overrides={"hardware": {"num_devices": 4}}))
    assert paper.strategy == "fsdp" and paper.shard_ranks == 4 and paper.ranks_per_node == 4
    assert Job.from_settings(settings_of()).strategy == "none"


def cpu_job(ranks: int, strategy: str = "fsdp", **changes) -> Job:
    return default_job(num_devices=ranks, replicated=strategy == "none", **{"ranks_per_node": ranks, **changes})


def test_fsdp_at_two_ranks_halves_the_sharded_terms_of_every_phase():
    shape, count = tiny_shape_and_count()
    one, two = (phase_memory(shape, count, cpu_job(n)) for n in (1, 2))
    weights, moments = 4 * count.total, 8 * count.total  # fp32 parameters, AdamW's two fp32 moments
    for phase in ("load", "checkpoint", "resume", "export"):
        assert one[phase]["device"]["weights"] == weights and two[phase]["device"]["weights"] == weights / 2, phase
    for phase in ("checkpoint", "resume", "export"):
        assert one[phase]["device"]["optimizer"] == moments and two[phase]["device"]["optimizer"] == moments / 2
    assert "optimizer" not in one["load"]["device"] and "gradients" not in one["checkpoint"]["device"]
    assert (
        one["resume"]["device"]["initial_gradients"] == weights
        and two["resume"]["device"]["initial_gradients"] == weights / 2
    )
    for term in ("weights", "gradients", "optimizer"):
        assert two["step"]["device"][term] == one["step"]["device"][term] / 2, term
    # on CPU one memory: the runtime once, nothing on the host side, a rank's figure is the device side
    runtime = CPU_RANK_RUNTIME_BYTES[compat.transformers_major()]
    assert two["checkpoint"]["device"] == {
        "weights": weights / 2,
        "optimizer": moments / 2,
        "runtime": runtime,
        "total": weights / 2 + moments / 2 + runtime,
    }
    for phase in PHASES:
        assert two[phase]["host"] == {"total": 0} and rank_bytes(two[phase]) == two[phase]["device"]["total"]
        assert two[phase]["device"]["runtime"] == runtime


def test_export_holds_one_whole_largest_tensor_and_none_holds_the_whole_model():
    shape, count = tiny_shape_and_count()
    # the tiny qwen3_moe's largest parameter: its 300 x 64 embedding (its experts are 8 x 64 x 32 per matrix)
    fused_experts = 8 * 2 * 32 * 64 if experts_fused("qwen3_moe") else 0
    assert count.largest_tensor == max(300 * 64, fused_experts)
    for ranks in (1, 4):
        export = phase_memory(shape, count, cpu_job(ranks))["export"]["device"]
        assert export["gathered_tensor"] == 4 * count.largest_tensor  # whole, on every rank count
    none = phase_memory(shape, count, cpu_job(4, "none"))
    for phase in ("load", "checkpoint", "resume", "export"):
        assert none[phase]["device"]["weights"] == 4 * count.total, phase
    assert none["checkpoint"]["device"]["optimizer"] == 8 * count.total
    assert none["step"]["device"] == memory_per_device(shape, count, cpu_job(1)) | {
        "total": none["step"]["device"]["total"]
    }
    assert none["step"]["device"]["unsharded_layer"] == 0


def test_host_memory_per_node_is_the_ranks_of_a_node_times_a_rank():
    shape, count = tiny_shape_and_count()
    job = cpu_job(4, ranks_per_node=2)
    phases = phase_memory(shape, count, job)
    for phase in phases.values():
        assert host_per_node_bytes(phase, job) == 2 * rank_bytes(phase)  # CPU: the whole figure
    cuda = dataclasses.replace(job, device="cuda")
    phases = phase_memory(shape, count, cuda)
    owned = -(-4 * count.largest_tensor // 4)
    assert phases["load"]["host"] == {"read_buffer": owned, "runtime": 3 * GIB, "total": owned + 3 * GIB}
    assert phases["export"]["host"]["staging_copy"] == 4 * count.largest_tensor
    assert phases["step"]["host"] == {"runtime": 3 * GIB, "total": 3 * GIB}
    assert host_per_node_bytes(phases["checkpoint"], cuda) == 2 * phases["checkpoint"]["host"]["total"]
    assert phases["checkpoint"]["device"]["runtime"] == GIB  # the CUDA context


def test_cpu_offload_moves_the_sharded_state_to_the_host_and_the_host_limit_binds(env_report):
    """``parallel.cpu_offload`` on CUDA: the step's weights, gradients and AdamW states per rank are the host's (a
    unit's shard copied each way is the device's), every other phase holds only the runtime on the device, and a
    node whose host cannot hold its ranks' states is refused, here where the ranks run."""
    shape, count = tiny_shape_and_count()
    on_device = phase_memory(shape, count, dataclasses.replace(cpu_job(2), device="cuda"))
    job = dataclasses.replace(cpu_job(2), device="cuda", cpu_offload=True)
    offloaded = phase_memory(shape, count, job)
    state = {k: on_device["step"]["device"][k] for k in ("weights", "gradients", "optimizer")}
    assert {k: offloaded["step"]["host"][k] for k in state} == state
    assert not set(state) & set(offloaded["step"]["device"])
    moved = sum(state.values()) - offloaded["step"]["device"]["offload_copies"]
    assert offloaded["step"]["device"]["total"] == on_device["step"]["device"]["total"] - moved
    for phase in ("load", "checkpoint", "resume", "export"):
        assert offloaded[phase]["device"] == {"runtime": GIB, "total": GIB}, phase
        assert (
            offloaded[phase]["host"]["total"]
            == on_device[phase]["host"]["total"] + on_device[phase]["device"]["total"] - GIB
        ), phase
    one = dataclasses.replace(job, num_devices=1, ranks_per_node=1)
    assert one.strategy == "fsdp" and one.sharded and one.shard_ranks == 1  # FSDP2 over a group of one
    cpu = phase_memory(shape, count, dataclasses.replace(job, device="cpu"))
    assert cpu["step"]["host"] == {"total": 0} and cpu["step"]["device"]["weights"] == state["weights"]

    if not compat.fsdp2_available():
        return  # the config check refuses cpu_offload on FSDP1 (tests/unit/test_bad_input.py)
    small_host = {"system": {**env_report["system"], "ram_usable_bytes": 4 * GIB}}
    offload = {"strategy": "fsdp", "cpu_offload": True, "nproc_per_node": 2}
    settings = parallel_settings(offload, {"device": "cuda", "memory_gib_per_device": 80})
    result = plan(settings, env_report | small_host)
    assert result["host"]["verdict"] == "does_not_fit" and result["job"]["cpu_offload"]
    with pytest.raises(PlanError, match="do not fit in the host memory"):
        enforce(result)
    enforce(plan(parallel_settings({**offload, "cpu_offload": False}, settings.hardware), env_report | small_host))


def test_plan_reports_every_phase_and_the_worst(env_report):
    result = plan(parallel_settings({"nproc_per_node": 2, "strategy": "fsdp"}), env_report)
    assert list(result["phases"]) == list(PHASES) and result["worst_phase"] == "step"
    assert result["per_device_bytes"] == result["phases"]["step"]["device_bytes"]
    assert result["job"]["strategy"] == "fsdp" and result["host"]["ranks_per_node"] == 2
    text, markdown = summary(result), render_markdown(result)
    assert "per rank and phase: load" in text and "worst phase step" in text
    assert (
        "## Memory per rank and phase (worst: step)" in markdown and "| term | load | step | checkpoint |" in markdown
    )


# --------------------------------------------------------------------------- LoRA


LORA_FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"]


@pytest.mark.parametrize("router", ["frozen", "trainable", "adapter"])
@pytest.mark.parametrize("name", LORA_FAMILIES)
def test_lora_arithmetic_matches_peft_trainable_parameters(name, router):
    """rank x (in + out) per adapted matrix, experts included, against what peft actually creates."""
    from moeflow.model import lora

    if router == "adapter" and name == "deepseek_v3" and not compat.is_transformers_v5():
        pytest.skip("a DeepSeek-V3 router adapter needs transformers 5 (tests/test_lora.py checks the error)")
    settings = lora_of(rank=4, alpha=8, targets=["all"], router=router)
    section = model_section(name)
    shape, _, _ = count_parameters(section, tokenizer_vocab=300)
    counted = lora_count(shape, settings)
    report = lora.trainable_parameter_report(
        lora.apply_lora(make_model(typed(ModelSettings, section), vocab_size=300), settings, False)
    )
    assert counted.trainable == report["trainable"] and counted.added == report["adapter"]
    for category, n in counted.by_category.items():
        expected = n + (counted.router_weights if category == "router" else 0)
        assert report["by_category"].get(category, {"trainable": 0})["trainable"] == expected, category


def test_lora_counts_each_expert_and_only_the_chosen_targets():
    shape, _, _ = count_parameters(model_section("deepseek_v3"), tokenizer_vocab=300)
    attention_only = lora_count(shape, lora_of(rank=8, targets=["attention"]))
    assert set(k for k, v in attention_only.by_category.items() if v) == {"attention"}
    experts = lora_count(shape, lora_of(rank=8, targets=["routed_experts"]))
    h, f, e = shape.hidden_size, shape.expert_ffn, shape.num_experts
    per_expert = 8 * ((h + 2 * f) + (f + h)) if experts_fused("deepseek_v3") else 8 * 3 * (h + f)
    assert experts.by_category["routed_experts"] == len(shape.moe_layers) * e * per_expert
    assert experts.router_weights == 0 and experts.trainable == experts.added


def test_lora_of_step3p5_flash_is_sharded_with_its_bf16_base(env_report):
    """LoRA shards under FSDP2 (#38): LoRA of Step-3.5-Flash on 8 x 80 GiB splits its frozen base (bf16) and its
    adapters (fp32, with fp32 gradients and AdamW's two moments, no master copy) over the 8 cards. It does not fit
    there: each MoE layer's 288 experts are gathered whole in bf16 (8.9 GiB), the next layer's prefetched, and peft
    folds the adapters into a third dense copy of the running layer's fused experts, whose gradient the backward pass
    builds too (8.4 GiB each; measured on the benchmark model, tests/pipeline/test_phase_memory.py); 14 cards would
    hold it (under ep it fits on 8: docs/training.md).
    On the pinned stack each expert is its own module (no fold): tight, and FSDP1 cannot shard LoRA. The full
    fine-tune, refused there, is offered QLoRA (an NF4 base, its experts dense one at a time) on 3 cards under ep and
    under fsdp, and LoRA under ep on 8 (each rank's experts are never gathered), where the stack can shard them
    (FSDP2) and bitsandbytes runs (torch 2.4)."""
    cards = {"hardware": {"memory_gib_per_device": 80, "num_devices": 8}}
    full = plan(settings_of(STEP3P5, overrides=cards), env_report)
    assert full["verdict"] == "does_not_fit" and full["min_devices"] > 40
    assert full["suggestions"] and all(o["strategy"] != "none" for o in full["suggestions"])
    lora_proposals = [o for o in full["suggestions"] if o["overlay"].get("train", {}).get("method") == "lora"]
    quantized = [o["overlay"].get("model", {}).get("quantization") for o in lora_proposals]
    assert [(o["strategy"], o["num_devices"]) for o in lora_proposals] == (
        [("ep", 3)] * 2 + [("fsdp", 3)] * 2 + [("ep", 8)] * 2 if compat.fsdp2_available() else []
    )
    assert quantized == (["nf4"] * 4 + [None] * 2 if compat.fsdp2_available() else [])
    lora = plan(settings_of(STEP3P5, overrides={**cards, "train": {"method": "lora"}}), env_report)
    fused = experts_fused("step3p5")  # transformers 5: peft folds the adapters into the fused experts
    assert lora["verdict"] == ("does_not_fit" if fused else "tight")
    assert lora["lora"]["trainable"] > 1e9  # every one of the 288 x 42 experts
    # on paper LoRA shards (a plan for the current stack's FSDP2); FSDP1 cannot, so no count fits it there
    assert lora["job"]["strategy"] == "fsdp" and lora["min_devices"] == (14 if compat.fsdp2_available() else None)
    folded = lora["per_device_gib"]["folded_experts"]
    assert 16.8 < folded < 17 if fused else not folded  # the running layer's fold and its gradient
    per_device, trainable = lora["per_device_bytes"], lora["lora"]["trainable"]
    assert per_device["weights"] == math.ceil((lora["parameters"]["total"] * 2 + trainable * 4) / 8)
    assert per_device["gradients"] == trainable * 4 / 8 and per_device["optimizer"] == trainable * 8 / 8
    assert 8.8 < lora["per_device_gib"]["unsharded_layer"] < 9
    assert lora["phases"]["load"]["device_bytes"]["weights"] == per_device["weights"]  # no fp32 copy in any phase
    assert "LoRA rank 16 on all, router frozen" in summary(lora) and "## LoRA adapters" in render_markdown(lora)


MASK_CASES = [("qwen3_moe", "sdpa"), ("qwen3_moe", "eager"), ("step3p5", "sdpa"), ("gpt_oss", "eager")]


@pytest.mark.parametrize(
    ("family", "attention"),
    [
        pytest.param(*c, marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="transformers 5 only"))
        if c[0] in TRANSFORMERS_5_ONLY
        else c
        for c in MASK_CASES
    ],
)
def test_the_planner_counts_the_attention_masks_a_packed_forward_builds(family, attention):
    """#36 item 5: with sdpa or eager attention, a forward on packed rows gives its attention modules a
    [B, 1, L, L] mask per attention type (transformers 5's booleans for sdpa, additive float masks for eager and
    where moeflow builds them): every distinct mask the attention modules receive, measured, is the planner's
    attention_masks term (gpt_oss runs its sinks in eager only)."""
    import torch
    from tiny_models import model_config

    from moeflow.data.collate import model_inputs

    cfg = model_config(family, attention)
    model = make_model(typed(ModelSettings, cfg), vocab_size=96, seed=0)
    masks = {}

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            masks[mask.data_ptr()] = mask.nbytes

    hooks = [
        m.register_forward_pre_hook(record, with_kwargs=True)
        for name, m in model.named_modules()
        if name.endswith("self_attn")
    ]
    micro_batch, length = 2, 24
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(micro_batch, 1)
    batch = {"input_ids": torch.randint(3, 90, (micro_batch, length)), "position_ids": positions}
    try:
        with torch.no_grad():
            model(**model_inputs(model, batch), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    shape = model_shape(dict(cfg["config"]), 96)
    job = default_job(micro_batch_size=micro_batch, seq_len=length, attn_implementation=attention)
    assert hooks and masks and sum(masks.values()) == attention_mask_bytes(shape, job), masks
    assert attention_mask_bytes(shape, dataclasses.replace(job, attn_implementation="flash_attention_2")) == 0


def test_the_planner_never_suggests_a_setting_the_job_already_has(env_report):
    """Qwen3-30B-A3B with LoRA on one 24 GiB card, with gradient checkpointing, micro-batch 1 and sdpa already
    set: refused, and none of those three settings is proposed (they were, #38); what is proposed is QLoRA (an NF4
    base) on 2 cards under ep and under fsdp, LoRA under ep and under fsdp on 6 (peft's fold of the fused experts and
    its gradient: folded_experts), sharded where the stack shards
    them (FSDP2), nothing on FSDP1 and torch 2.3, which the config check refuses.
    tests/unit/test_proposals.py checks every proposal over a grid of models and hardware."""
    settings = settings_of(
        QWEN3_30B,
        overrides={
            "hardware": {"memory_gib_per_device": 24, "num_devices": 1},
            "parallel": {"strategy": "none", "nproc_per_node": 1},
            "data": {"seq_len": 2048},
            "train": {"method": "lora", "micro_batch_size": 1, "gradient_checkpointing": True},
            "model": {"attn_implementation": "sdpa"},
        },
    )
    result = plan(settings, env_report)
    assert result["verdict"] == "does_not_fit"
    if compat.fsdp2_available():
        assert [(o["change"], o["num_devices"]) for o in result["suggestions"]] == [
            (
                "model.quantization: nf4, parallel.strategy: ep, parallel.nproc_per_node: 2, parallel.ep_size: 2, "
                "hardware.num_devices: 2",
                2,
            ),
            (
                "model.quantization: nf4, parallel.strategy: fsdp, parallel.nproc_per_node: 2, hardware.num_devices: 2",
                2,
            ),
            ("parallel.strategy: ep, parallel.nproc_per_node: 6, parallel.ep_size: 2, hardware.num_devices: 6", 6),
            ("parallel.strategy: fsdp, parallel.nproc_per_node: 6, hardware.num_devices: 6", 6),
        ]
    else:
        assert result["suggestions"] == [] and result["min_devices"] is None
        assert "no configuration the planner searched" in summary(result)
    # the frozen base in bf16 in every phase (it was counted in fp32 outside the step, #38): 30.5B x 2 bytes
    weights = {phase: p["device_bytes"]["weights"] for phase, p in result["phases"].items()}
    assert len(set(weights.values())) == 1 and 59 * GIB < weights["load"] < 61 * GIB, weights
