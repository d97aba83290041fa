"""Scaling out on paper: profiles vs configs, the planner at real scale, cost; the parallel section and the
copied recipe's expert-parallel flags."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from moeflow.parallel.launch import LaunchError, torchrun_command
from moeflow.plan import counts, shapes
from moeflow.plan.fit import device_memory
from moeflow.plan.forward import ForwardJob, forward_plan
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, ConfigError
from moeflow.workflow.keys import forward_batch, forward_plan_settings, forward_stages, plan_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.merge import deep_merge
from moeflow.workflow.recipe import translate_recipe_flags
from moeflow.workflow.scaleout import (
    ASSUMED_MFU,
    DEFAULT_TOKEN_BUDGET,
    ScaleoutError,
    cost,
    hardware_overlay,
    layout,
    markdown_row,
    phase_rows,
    phase_table,
    profile_request,
    request_problems,
    scaleout_plan,
    wall_hours_fit,
)

MODELS = REPO_ROOT / "config" / "models"
# Each shipped large model, the profile its training runs with, and the overlay of that profile's hardware.
LARGE_MODELS = {
    "qwen3-30b-a3b": "slurm",
    "step3p5-flash": "slurm-multinode",
}


def cluster_config(model: str, profile: str, overrides=None) -> dict:
    return run_config(load(MODELS / f"{model}.yaml", hardware_overlay(profile), overrides=overrides), "moe")


@pytest.mark.parametrize("model,profile", sorted(LARGE_MODELS.items()))
def test_config_names_what_its_profile_requests(model, profile):
    request = profile_request(profile)
    assert request.gpus == request.gpus_per_node * request.nodes and request.gpu_memory_gib == 80
    assert request_problems(cluster_config(model, profile), request) == []
    # the warmup gets the same GPUs as train_model (the checkpoint is resumed on the same layout)
    warmup = profile_request(profile, "warmup")
    assert (warmup.gpus, warmup.nodes, warmup.gpu_model) == (request.gpus, request.nodes, request.gpu_model)


def test_qwen3_overlay_alone_already_names_the_profiles_hardware():
    cfg = run_config(load(MODELS / "qwen3-30b-a3b.yaml"), "moe")
    assert request_problems(cfg, profile_request("slurm")) == []


@pytest.mark.parametrize("model,profile", sorted(LARGE_MODELS.items()))
def test_planner_accepts_the_profiles_gpus_and_refuses_fewer(model, profile):
    request = profile_request(profile)
    p = scaleout_plan(cluster_config(model, profile), request)
    # Counting every term a GPU holds (the prefetched layer, the root unit, the logits, the card's visible memory),
    # the profiles' GPUs fit without the planner's 10% headroom ("tight"): Qwen3-30B-A3B's realistic peak is
    # 73-77 GiB of ~79 GiB. One GPU fewer (or one node fewer) does not fit at all.
    assert p["on_request"]["verdict"] in ("fits", "tight")
    assert p["on_request"]["per_gpu_gib"]["total"] <= request.gpu_memory_gib
    assert p["on_fewer"]["gpus"] < request.gpus and p["on_fewer"]["verdict"] == "does_not_fit"
    assert p["on_fewer"]["gpus"] < p["min_gpus"]


def test_layouts_at_real_scale():
    qwen = scaleout_plan(cluster_config("qwen3-30b-a3b", "slurm"), profile_request("slurm"))
    assert (qwen["layout"]["world_size"], qwen["layout"]["fsdp_size"], qwen["layout"]["ep_size"]) == (8, 8, 1)
    assert qwen["layout"]["strategy"] == "fsdp" and qwen["layout"]["gradient_checkpointing"]
    assert not qwen["layout"]["needs_transformers_5"]
    step = scaleout_plan(cluster_config("step3p5-flash", "slurm-multinode"), profile_request("slurm-multinode"))
    assert (step["layout"]["world_size"], step["layout"]["fsdp_size"], step["layout"]["ep_size"]) == (48, 48, 8)
    assert step["layout"]["experts_per_rank"] == 288 / 8 and step["layout"]["needs_transformers_5"]
    assert step["job"]["expert_parallel"] and step["layout"]["gradient_checkpointing"]
    # under expert parallelism only the dense part of a layer is gathered: far less than the whole layer
    fsdp_only = scaleout_plan(
        cluster_config(
            "step3p5-flash",
            "slurm-multinode",
            {"parallel": {"strategy": "fsdp", "ep_size": 1, "ep_implementation": "auto"}},
        ),
        profile_request("slurm-multinode"),
    )
    assert (
        step["on_request"]["per_gpu_gib"]["unsharded_layer"] * 5
        < fsdp_only["on_request"]["per_gpu_gib"]["unsharded_layer"]
    )


def test_cost_is_six_n_flop_bearing_tokens_at_the_assumed_mfu():
    c = cost(flop_bearing_parameters=3_000_000_000, tokens=10**9, gpus=8, peak_flops=1e15, mfu=0.25)
    assert c["flops"] == 6 * 3e9 * 1e9
    assert c["gpu_hours"] == pytest.approx(1.8e19 / 2.5e14 / 3600)
    assert c["wall_hours"] == pytest.approx(c["gpu_hours"] / 8)
    step = scaleout_plan(cluster_config("step3p5-flash", "slurm-multinode"), profile_request("slurm-multinode"))
    assert step["cost"]["assumed_mfu"] == ASSUMED_MFU
    assert step["cost"]["flops"] == 6 * step["parameters"]["flop_bearing_per_token"] * DEFAULT_TOKEN_BUDGET
    assert wall_hours_fit(profile_request("slurm-multinode").runtime_min, step)


def test_the_cost_counts_the_input_embedding_lookup_as_no_flops():
    """An untied head's matmul counts, the input embedding's lookup does not; a tied one counts once, as the head."""
    for name in ("qwen3-30b-a3b", "step3p5-flash"):
        settings = plan_settings(cluster_config(name, "slurm-multinode"))
        _, params, _ = counts.count_parameters(settings["model"], settings["vocab_size"])
        embedding, head = params.by_category["embedding"], params.by_category["lm_head"]
        assert head == embedding > 0  # both untie their head: two vocab x hidden matrices
        assert params.flop_bearing == params.active - embedding
        planned = scaleout_plan(cluster_config(name, "slurm-multinode"), profile_request("slurm-multinode"))
        assert planned["cost"]["flops"] == 6 * (params.active - embedding) * DEFAULT_TOKEN_BUDGET
    tied = dataclasses.replace(params, by_category={**params.by_category, "lm_head": 0})
    assert tied.flop_bearing == tied.active


def test_profile_without_gpus_for_the_rule_is_an_error(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.yaml").write_text(
        "executor: slurm\ndefault-resources: {slurm_partition: cpu, mem_mb: 1000, runtime: 10}\n"
    )
    with pytest.raises(ScaleoutError, match="requests no GPUs"):
        profile_request("p", profiles=tmp_path)


# --------------------------------------------------------------------------- the parallel section


def test_default_parallel_section_is_one_process():
    cfg = load()
    assert cfg["parallel"]["strategy"] == "none" and cfg["parallel"]["nproc_per_node"] * cfg["parallel"]["nnodes"] == 1
    assert layout(run_config(cfg, "moe"))["world_size"] == 1


@pytest.mark.parametrize(
    "parallel,hardware,message",
    [
        ({"strategy": "ep"}, {}, "parallel.strategy"),
        ({"nproc_per_node": 2}, {}, "must agree"),
        (
            {"nproc_per_node": 4, "strategy": "ep", "ep_size": 3},
            {"num_devices": 4},
            "parallel.ep_size' \\(3\\) must divide",
        ),
        (
            {"nproc_per_node": 4, "strategy": "fsdp", "fsdp_size": 3},
            {"num_devices": 4},
            "parallel.fsdp_size' \\(3\\) must divide",
        ),
        ({"nproc_per_node": 2, "fsdp_size": 2}, {"num_devices": 2}, "strategy is 'none'"),
    ],
)
def test_inconsistent_parallel_layouts_are_refused_naming_the_keys(parallel, hardware, message):
    with pytest.raises(ConfigError, match=message):
        load(overrides={"parallel": parallel, "hardware": hardware})


def test_unknown_parallel_key_is_a_schema_error():
    with pytest.raises(ConfigError, match="'tp_size' was unexpected|unknown key\\(s\\) 'tp_size'"):
        load(overrides={"parallel": {"tp_size": 2}})


def test_two_cpu_ranks_layout_is_valid():
    cfg = load(overrides={"parallel": {"nproc_per_node": 2, "strategy": "fsdp"}, "hardware": {"num_devices": 2}})
    assert layout(run_config(cfg, "moe"))["fsdp_size"] == 2


# --------------------------------------------------------------------------- the copied recipe's flags


# Expert parallelism trains the embedded default with untied embeddings (the config check refuses tied ones under ep:
# transformers 5's expert-parallel sharding unties them).
UNTIED = {"config": {"tie_word_embeddings": False}}


def test_recipe_launch_flags_map_to_the_parallel_section_or_are_refused():
    # torchrun --nproc_per_node 4 train.py --moe_expert_parallel_degree 2 --moe_token_dispatcher_type balance
    #   --moe_eval_capacity_factor 1.2, and group_experts_by: device
    overrides, refused = translate_recipe_flags(
        {
            "--moe_expert_parallel_degree": 2,
            "--moe_token_dispatcher_type": "balance",
            "--moe_eval_capacity_factor": 1.2,
            "group_experts_by": "device",
        }
    )
    assert overrides == {"parallel": {"strategy": "ep", "ep_size": 2}}
    assert len(refused) == 2
    assert any("moe_token_dispatcher_type" in r and "train.balance" in r for r in refused)
    assert any("moe_eval_capacity_factor" in r and "dropless" in r for r in refused)
    # the mapped settings make a valid config on 4 ranks (the recipe's --nproc_per_node 4)
    four = {"parallel": {"nproc_per_node": 4}, "hardware": {"num_devices": 4}, "model": UNTIED}
    cfg = load(overrides=deep_merge(overrides, four))
    assert layout(run_config(cfg, "moe"))["ep_size"] == 2


@pytest.mark.parametrize("value", ["alltoall", "all_to_all"])
def test_dispatcher_types_with_a_transformers_equivalent_map_to_ep_implementation(value):
    overrides, refused = translate_recipe_flags({"moe_token_dispatcher_type": value})
    assert overrides == {"parallel": {"ep_implementation": "all_to_all"}} and refused == []


def test_the_allgather_dispatcher_is_refused_not_mapped_to_all_reduce():
    """transformers' all_reduce dispatch needs ep_size == tp_size, and moeflow's tp_size is 1: it would crash
    at start (#36 item 6), so the recipe's allgather is refused, and so is the key itself."""
    overrides, refused = translate_recipe_flags({"moe_token_dispatcher_type": "allgather"})
    assert overrides == {} and len(refused) == 1 and "tensor parallelism" in refused[0]
    ep = {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2, "ep_implementation": "all_reduce"}
    with pytest.raises(ConfigError, match=r"'parallel.ep_implementation': all_reduce .* use all_to_all"):
        load(overrides={"parallel": ep, "hardware": {"num_devices": 2}})


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("moe_expert_parallel_degree", 2, "parallel: {strategy: ep, ep_size: 2}"),
        ("moe_token_dispatcher_type", "alltoall", "parallel.ep_implementation: all_to_all"),
        ("moe_token_dispatcher_type", "balance", "refused"),
        ("moe_eval_capacity_factor", 1.2, "dropless"),
        ("group_experts_by", "device", "parallel: {strategy: ep"),
        ("group_experts_by", "layer", "refused"),
    ],
)
def test_a_config_with_a_recipe_flag_fails_with_the_real_setting(key, value, says):
    with pytest.raises(ConfigError) as err:
        load(overrides={"train": {key: value}})
    assert f"train.{key}" in str(err.value) and says in str(err.value)


# --------------------------------------------------------------------------- the launcher


def test_launcher_starts_one_rank_per_gpu_or_the_cpu_ranks():
    # one rank on one node: the script in the interpreter alone (process_group.init's one-process defaults)
    assert torchrun_command("python") == "python" and torchrun_command("python", gpus=1) == "python"
    assert torchrun_command("python", gpus=2, nodes=2).startswith("srun ")  # one GPU on each of two nodes
    assert torchrun_command("python", cpu_ranks=2) == (
        "python -m torch.distributed.run --standalone --monitor-interval 0.5 --nproc_per_node 2"
    )
    assert torchrun_command("python", gpus=8).endswith("--nproc_per_node 8")
    request = profile_request("slurm-multinode")
    multi = torchrun_command("python", gpus=request.gpus, nodes=request.nodes, threads=32)
    assert multi.startswith(
        f"srun --overlap --nodes {request.nodes} --ntasks-per-node 1 --cpus-per-task 32 "
        f"--gpus-per-node {request.gpus_per_node} python -m torch.distributed.run"
    )
    assert f"--nproc_per_node {request.gpus_per_node} --nnodes {request.nodes} --rdzv-backend c10d" in multi
    assert "--standalone" not in multi and "--gpus-per-node" not in torchrun_command("python", nodes=2)
    # the nodes from SLURM_JOB_NODELIST, or from squeue where the executor plugin's jobstep removed it
    # (tests/pipeline/test_slurm.py runs both profiles' training jobs on a real SLURM)
    assert '${SLURM_JOB_NODELIST:-$(squeue --noheader --jobs "$SLURM_JOB_ID" --format %N)}' in multi
    with pytest.raises(LaunchError, match="evenly"):
        torchrun_command("python", gpus=12, nodes=8)


def test_markdown_row_shows_the_plans_numbers():
    p = scaleout_plan(cluster_config("qwen3-30b-a3b", "slurm"), profile_request("slurm"))
    row = markdown_row("Qwen3-30B-A3B", p)
    assert f"**{p['on_request']['per_gpu_gib']['total']:.1f}** of 80" in row and "8 x H100 (1 node)" in row
    assert f"{p['cost']['gpu_hours']:.0f} GPU-h" in row and "`profiles/slurm`" in row


# --------------------------------------------------------------------------- docs/memory-plan.md's table of phases


@pytest.mark.skipif(
    not compat.is_transformers_v5(), reason="docs/memory-plan.md's table is the current stack's (FSDP2, fused experts)"
)
def test_memory_plan_docs_phase_table_is_the_planners_output(monkeypatch):

    # the closed form (the meta count of Qwen3-30B-A3B's experts takes ~40 s; tests/unit/test_plan.py checks
    # that both agree, the largest tensor included)
    monkeypatch.setattr(counts, "meta_count", lambda config, shape: None)
    doc = (REPO_ROOT / "docs" / "memory-plan.md").read_text(encoding="utf-8")
    table = doc.split("<!-- phase-table:start -->\n")[1].split("<!-- phase-table:end -->")[0]
    assert table == phase_table()


def test_phase_table_rows_use_each_models_layout(monkeypatch):

    monkeypatch.setattr(counts, "meta_count", lambda config, shape: None)
    rows = phase_rows(nodes=(1, 8))
    lora = "fsdp" if compat.fsdp2_available() else "none"  # FSDP1 cannot shard LoRA (one dtype per unit)
    layouts = {(r["model"], r["method"]): r["job"].strategy for r in rows}
    assert layouts == {
        ("Qwen3-30B-A3B", "full"): "fsdp",
        ("Qwen3-30B-A3B", "lora"): lora,
        ("Step-3.5-Flash", "full"): "ep",
        ("Step-3.5-Flash", "lora"): lora,
    }
    by = {(r["model"], r["method"], r["request"].nodes): r for r in rows}
    qwen_one, qwen_eight = by[("Qwen3-30B-A3B", "full", 1)], by[("Qwen3-30B-A3B", "full", 8)]
    assert qwen_one["job"].ranks_per_node == qwen_eight["job"].ranks_per_node == 8
    assert qwen_eight["device_gib"]["checkpoint"] < qwen_one["device_gib"]["checkpoint"] / 6  # states over 64 GPUs
    assert (
        by[("Step-3.5-Flash", "full", 8)]["verdict"] == "fits"
        and by[("Step-3.5-Flash", "full", 1)]["verdict"] == "does_not_fit"
    )
    lora_one, lora_eight = by[("Qwen3-30B-A3B", "lora", 1)], by[("Qwen3-30B-A3B", "lora", 8)]
    assert lora_one["verdict"] != "does_not_fit"  # tight on transformers 4.57 (an adapter per expert projection)
    if lora == "none":  # every GPU holds the whole model, on one node or eight; its frozen base in bf16 (61 GB)
        assert lora_one["device_gib"] == lora_eight["device_gib"] and 56 < lora_one["device_gib"]["load"] < 64
    else:  # the frozen base and the adapters split over the GPUs (8 or 64), beside a fixed runtime
        assert (
            lora_eight["device_gib"]["load"] < lora_one["device_gib"]["load"] / 4
            and lora_one["device_gib"]["load"] < 10
        )


# --------------------------------------------------------------------------- the profiles' rules


def test_default_profile_is_minimal_and_local():
    cfg = yaml.safe_load((REPO_ROOT / "profiles" / "default" / "config.yaml").read_text())
    assert cfg == {"printshellcmds": True}


def rules_on_the_device() -> set[str]:
    """The rules whose stage runs a model on ``hardware.device``: a script calling compute_device, or torchrun."""
    rules = set()
    for smk in sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]:
            name = block.split(":", 1)[0]
            script = re.search(r'script:\s*"\.\./scripts/(\w+\.py)"', block)
            on_device = script and "compute_device(" in (REPO_ROOT / "workflow" / "scripts" / script[1]).read_text()
            if on_device or "TORCHRUN_SHELL" in block:
                rules.add(name)
    return rules


@pytest.mark.parametrize("profile", ["slurm", "slurm-multinode"])
def test_every_rule_that_runs_a_model_on_the_device_gets_a_gpu(profile):
    cfg = yaml.safe_load((REPO_ROOT / "profiles" / profile / "config.yaml").read_text())
    on_gpu = {rule for rule, res in cfg["set-resources"].items() if res.get("gpu") and res["slurm_partition"] == "gpu"}
    assert {"choose_experts", "pretrain_base", "warmup", "train_model", "lm_eval_task"} <= rules_on_the_device()
    assert rules_on_the_device() - on_gpu == set()


# The torchrun rules of evaluation's layout: the profile's GPUs are the ranks their launcher starts, which the
# script checks against evaluate.ranks (moeflow.parallel.process_group.check_ranks).
EVALUATE_RANKS_RULES = ("evaluate_model", "lm_eval_task", "humaneval_generate")


# The torchrun rules of coverage's layout (the routing pass over the base model): coverage.ranks.
COVERAGE_RANKS_RULES = ("coverage_valset", "esft_routing")


@pytest.mark.parametrize("model,profile", sorted(LARGE_MODELS.items()))
def test_the_profile_gives_each_forward_only_rule_its_sections_ranks_as_gpus(model, profile):
    cfg = cluster_config(model, profile)
    for section, rules in (("evaluate", EVALUATE_RANKS_RULES), ("coverage", COVERAGE_RANKS_RULES)):
        for rule in rules:
            assert profile_request(profile, rule).gpus == cfg[section]["ranks"], rule
    if model == "step3p5-flash":  # 392 GB of bf16: never on one 80 GB GPU
        assert cfg["coverage"]["ranks"] == cfg["evaluate"]["ranks"] == cfg["parallel"]["nproc_per_node"]


@pytest.mark.parametrize("model,profile", sorted(LARGE_MODELS.items()))
def test_each_forward_only_stage_fits_on_its_profiles_gpus_and_not_on_half(model, profile):
    """Every forward-only stage of the run, planned per rank on its section's ranks in its layout
    (moeflow.plan.forward: weights in bf16, the gathered layers, one layer's tensors, router scores, chunked
    logits or the KV cache), fits on the GPUs its profile gives it; on half of them it does not."""
    cfg = cluster_config(model, profile)
    shape, params, _ = counts.count_parameters(cfg["model"], cfg["tokenizer"]["vocab_size"])
    memory, _ = device_memory(cfg["hardware"], {})
    assert set(forward_stages(cfg)) == set(EVALUATE_RANKS_RULES) | {"coverage_valset"}
    for stage in forward_stages(cfg):
        job = ForwardJob.from_settings(forward_plan_settings(cfg, stage))
        gpus = profile_request(profile, stage).gpus
        p = forward_plan(shape, params, job, memory)
        assert (p["ranks"], p["verdict"]) == (gpus, "fits"), (stage, p["phases"]["forward"])
        if gpus > 1:  # half the ranks, sharded the same (an ep_size of all of them: fsdp)
            fewer = job.on(gpus // 2) or dataclasses.replace(
                job, layout=dataclasses.replace(job.layout, expert_parallel=False)
            ).on(gpus // 2)
            half = forward_plan(shape, params, fewer, memory)
            assert half["verdict"] == "does_not_fit" and p["min_ranks"] > gpus // 2, stage


class _Card:
    total_memory = int(23.68 * 2**30)  # what torch sees of a 24 GB card


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_forward_only_stage_that_does_not_fit_its_gpu_is_refused_before_it_loads(tmp_path, monkeypatch, ranks):
    """At its start (moeflow.plan.forward.refuse_unless_fits, before the load), lm_eval_task for Qwen3-30B-A3B (a
    folder with its config.json: 57 GiB of bf16 weights) on one 24 GB card is refused naming its section's keys
    and the ranks it fits on, and accepted on those; on the CPU nothing is checked."""
    import json

    import torch

    from moeflow.loading.factory import Layout
    from moeflow.parallel.process_group import Ranks
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.plan.forward import refuse_unless_fits
    from moeflow.plan.shapes import PlanError
    from moeflow.settings import typed

    cfg = cluster_config("qwen3-30b-a3b", "slurm")
    folder = tmp_path / "qwen3"
    folder.mkdir()
    config = shapes.hf_config_fields(shapes.model_config_fields(cfg["model"]), cfg["tokenizer"]["vocab_size"])[1]
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    batch = forward_batch(cfg, "lm_eval_task")
    model = cfg["model"] | {"config": {}}

    def layout(n: int, device: str = "cuda") -> Layout:
        parallel = typed(ParallelSettings, {"strategy": "none" if n == 1 else "fsdp", "nproc_per_node": n})
        return Layout(Ranks(rank=0, world_size=n, local_rank=0, device=torch.device(device)), parallel, None, "bf16")

    assert refuse_unless_fits(batch, model, folder, layout(ranks, "cpu")) is None
    with pytest.raises(PlanError) as refused:
        refuse_unless_fits(batch, model, folder, layout(ranks))
    message = str(refused.value)
    fits_on = re.search(r"it fits on (\d+): set evaluate.ranks: (\d+)", message)
    assert (
        message.startswith("does not fit: rule lm_eval_task on its")
        and "'evaluate.ranks' and 'evaluate.strategy'" in message
    )
    assert fits_on and fits_on[1] == fits_on[2] and int(fits_on[1]) > ranks
    assert "'evaluate.lm_eval.batch_size'" in message
    assert refuse_unless_fits(batch, model, folder, layout(int(fits_on[1])))["verdict"] == "fits"


TRAINING_LAYOUTS = [
    {"strategy": "none", "nproc_per_node": 1},
    {"strategy": "fsdp", "nproc_per_node": 2},
    {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2},
    {"strategy": "ep", "ep_size": 2, "fsdp_size": 4, "nproc_per_node": 4},
    {"strategy": "ep", "ep_size": 4, "nproc_per_node": 4},
]


@pytest.mark.parametrize("parallel", TRAINING_LAYOUTS, ids=lambda p: f"{p['strategy']}{p['nproc_per_node']}")
def test_every_accepted_forward_stage_layout_tiles_its_ranks(parallel):
    """#36 item 12: over training layouts x the forward stages' ranks and strategies, a config the check accepts
    gives every forward-only stage (coverage.*, evaluate.*) a layout that tiles its ranks, and one it refuses
    names the section's keys. The defaults (ranks 1, strategy null) are always accepted."""
    from moeflow.workflow.keys import forward_parallel

    accepted = 0
    for ranks in (1, 2, 3, 4):
        for strategy in (None, "none", "fsdp", "ep"):
            forward = {"ranks": ranks, "strategy": strategy}
            overrides = {
                "parallel": parallel,
                "hardware": {"num_devices": parallel["nproc_per_node"]},
                "coverage": forward,
                "evaluate": forward,
                **({"model": UNTIED} if parallel["strategy"] == "ep" else {}),
                "runs": {"lora": None},  # whole models only: with fsdp_size set, its strategy none is refused
            }
            try:
                cfg = run_config(load(overrides=overrides), "moe")
            except ConfigError as err:
                assert "'coverage.ranks'" in str(err) or "'evaluate.ranks'" in str(err), (forward, str(err))
                assert "'parallel.ep_size'" in str(err) and forward["strategy"] in (None, "ep"), (forward, str(err))
                continue
            accepted += 1
            for section in ("coverage", "evaluate"):
                layout = forward_parallel(cfg, section)
                assert layout["nproc_per_node"] == ranks and layout["fsdp_size"] is None
                if layout["strategy"] == "ep":
                    assert layout["ep_size"] > 1 and ranks % layout["ep_size"] == 0, (forward, layout)
                    if compat.is_transformers_v5():  # transformers' own tiling check
                        from moeflow.parallel.layouts import distributed_config
                        from moeflow.parallel.settings import ParallelSettings
                        from moeflow.settings import typed

                        distributed_config(typed(ParallelSettings, layout), "fp32", world=ranks)
                else:
                    assert layout["ep_size"] == 1
            if ranks == 1 and strategy is None:  # one rank holds the whole model, whatever training's layout
                assert forward_parallel(cfg, "coverage")["strategy"] == "none"
    assert accepted >= 8
