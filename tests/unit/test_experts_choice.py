"""The experts implementation chosen by measurement (moeflow.model.experts_choice, rule choose_experts)."""

from __future__ import annotations

import re
import time

import pytest
import torch
import yaml
from conftest import SMOKE, copy_workflow, snakemake
from tiny_models import model_config, tiny_dense_cfg, tiny_model_cfg

from moeflow.model import experts_choice as X
from moeflow.model.folder import ModelError
from moeflow.model.settings import ModelSettings
from moeflow.paper.build import experts_choice_line
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed

CPU = torch.device("cpu")
MICRO_BATCH, SEQ_LEN = 2, 64


def auto(cfg: dict) -> ModelSettings:
    return typed(ModelSettings, cfg | {"experts_implementation": "auto"})


@pytest.fixture(scope="module")
def block() -> X.MoEBlock:
    return X.moe_block(typed(ModelSettings, tiny_model_cfg()), MICRO_BATCH, SEQ_LEN, CPU)


def planted(run: X.Run, plants: dict) -> X.Run:
    """``run`` with extra implementations: each a function of eager's (output, gradients)."""

    def call(name: str):
        if name in plants:
            return plants[name](*run(X.REFERENCE))
        return run(name)

    return call


def test_the_candidates_are_what_the_stack_runs():
    names = X.candidates(CPU)
    assert names == (["eager", "grouped_mm", "batched_mm"] if compat.is_transformers_v5() else ["eager"])


def test_the_block_is_the_runs_first_moe_layer_materialised_alone(block):
    assert block.shape == {
        "model_type": "qwen3_moe",
        "layer": 0,
        "hidden_size": 32,
        "expert_width": 16,
        "num_experts": 4,
        "top_k": 2,
        "micro_batch_size": MICRO_BATCH,
        "seq_len": SEQ_LEN,
        "tokens": MICRO_BATCH * SEQ_LEN,
        "weights": "fp32",
        "ep_size": 1,
        "experts_per_rank": 4,
    }
    assert all(p.device == CPU for p in block.module.parameters())
    assert all(p.is_meta for p in block.model.get_input_embeddings().parameters())  # the rest is never allocated


def test_a_real_timing_at_a_small_shape_reports_every_implementation():
    report = X.measure(auto(tiny_model_cfg()), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    results = report["implementations"]
    assert list(results) == X.candidates(CPU) and results["eager"]["max_relative_difference"] == 0
    if not compat.is_transformers_v5():  # the pinned stack's only implementation: the per-expert loop
        assert report["chosen"] == "eager" and "per-expert loop" in report["reason"]
        return
    assert results["grouped_mm"]["eligible"], results["grouped_mm"]  # agrees with eager in fp32 on the CPU
    eligible = [n for n, r in results.items() if r["eligible"]]
    assert all(len(results[n]["rounds_s"]) == X.ROUNDS for n in eligible)
    assert report["chosen"] == "eager" and "ms" in report["reason"]  # on the CPU: eager, whatever the timings
    timed = X.choose(results)[0]
    assert timed in eligible and (timed == "eager" or f"would pick {timed} " in report["reason"]), report["reason"]
    assert "model.experts_implementation" in report["reason"]


def test_on_a_gpu_the_timings_decide_and_on_the_cpu_eager():
    rounds = {
        "eager": {"eligible": True, "rounds_s": [0.01] * X.ROUNDS, "median_s": 0.01},
        "grouped_mm": {"eligible": True, "rounds_s": [0.002] * X.ROUNDS, "median_s": 0.002},
    }
    assert X.decide("cuda", rounds)[0] == "grouped_mm"
    chosen, reason = X.decide("cpu", rounds)
    assert chosen == "eager" and "eager on the CPU" in reason and "would pick grouped_mm" in reason


def test_the_block_is_fp32_whatever_dtype_the_config_names():
    """A published folder's config says bfloat16 (Step-3.5-Flash's does); moeflow holds models in fp32, and the
    timed block with them (its inputs are fp32) where training holds them so (parallel.strategy: none)."""
    bf16 = X.moe_block(typed(ModelSettings, tiny_model_cfg(torch_dtype="bfloat16")), MICRO_BATCH, SEQ_LEN, CPU)
    assert {p.dtype for p in bf16.module.parameters()} == {torch.float32}
    X.block_runner(bf16, "fp32")(X.REFERENCE)


@pytest.mark.parametrize(
    ("precision", "strategy", "weights"),
    [("bf16", "none", "fp32"), ("bf16", "fsdp", "bf16"), ("bf16", "ep", "bf16"), ("fp32", "fsdp", "fp32")],
)
def test_the_block_is_timed_with_the_weights_training_runs(precision, strategy, weights):
    """FSDP's mixed precision gathers bf16 parameters (fsdp, ep): the block is timed with bf16 weights and bf16
    hidden states, the routers the model class keeps in fp32 (transformers 5's DeepSeek-V3 gate) in fp32; under
    strategy none
    every rank holds the fp32 model under autocast."""
    assert X.weights_dtype(precision, strategy) == weights
    block = X.moe_block(typed(ModelSettings, model_config("deepseek_v3")), MICRO_BATCH, SEQ_LEN, CPU, weights=weights)
    dtypes = {n: p.dtype for n, p in block.module.named_parameters()}
    want = torch.bfloat16 if weights == "bf16" else torch.float32
    kept_fp32 = "gate.weight" in (getattr(block.model, "_keep_in_fp32_modules_strict", None) or [])  # transformers 5
    assert {d for n, d in dtypes.items() if "experts" in n} == {want}
    assert dtypes["gate.weight"] == (torch.float32 if kept_fp32 else want)
    assert block.shape["weights"] == weights
    out, grads = X.block_runner(block, precision)(X.REFERENCE)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


def test_under_expert_parallelism_the_block_holds_one_ranks_experts():
    """ep_size 2 of 4 experts: the block has 2 experts, fed the rank's tokens (all-to-all sends each rank the
    routed tokens of its experts); a size that does not divide the experts is refused naming the key."""
    settings = typed(ModelSettings, tiny_model_cfg())
    block = X.moe_block(settings, MICRO_BATCH, SEQ_LEN, CPU, weights="bf16", ep_size=2)
    assert block.shape["num_experts"] == 4 and block.shape["experts_per_rank"] == 2 and block.shape["ep_size"] == 2
    assert block.shape["tokens"] == MICRO_BATCH * SEQ_LEN
    report = X.measure(auto(tiny_model_cfg()), MICRO_BATCH, SEQ_LEN, CPU, "bf16", strategy="ep", ep_size=2)
    assert report["shape"]["experts_per_rank"] == 2 and report["shape"]["weights"] == "bf16"
    with pytest.raises(ModelError, match="'parallel.ep_size': 3 does not divide the model's 4 experts"):
        X.moe_block(settings, MICRO_BATCH, SEQ_LEN, CPU, ep_size=3)


class LoadedMachine:
    """A planted clock: each call of an implementation takes its true time times the machine's load, which
    changes over the measurement (``load``: by call count), plus a small jitter."""

    def __init__(self, true_s: dict, load, seed: int):
        self.true_s, self.load, self.now, self.calls = true_s, load, 0.0, 0
        self.rng = torch.Generator().manual_seed(seed)

    def clock(self) -> float:
        return self.now

    def run(self, name: str):
        jitter = 1 + 0.05 * (2 * float(torch.rand(1, generator=self.rng)) - 1)
        self.now += self.true_s[name] * self.load(self.calls) * jitter
        self.calls += 1
        return torch.ones(2), [torch.ones(2)]


LOADS = {
    "idle": lambda call: 1.0,
    "busier later": lambda call: 1.0 if call < 6 else 2.3,
    "busier first": lambda call: 2.3 if call < 6 else 1.0,
    "bursts": lambda call: (1.0, 2.2, 1.3, 3.0, 1.0, 1.8)[call % 6],
}


@pytest.mark.parametrize("true_s", [{"eager": 5.8e-3, "grouped_mm": 5.2e-3}, {"eager": 13e-3, "grouped_mm": 4e-3}])
def test_machine_load_does_not_flip_the_choice_and_the_choice_file_is_the_same(true_s):
    """Item 19's smoke runs: eager 5.8 ms vs grouped_mm 8.2 ms in one run, 13.0 vs 8.8 ms in the other, under
    other load. Interleaved rounds and the margin give one choice under every load pattern: eager when the two
    are close, grouped_mm when it is clearly faster, and the same choice file."""
    want = "eager" if true_s["eager"] < X.MIN_SPEEDUP * true_s["grouped_mm"] else "grouped_mm"
    files = set()
    for (load_name, load), seed in ((item, seed) for item in LOADS.items() for seed in range(5)):
        machine = LoadedMachine(true_s, load, seed)
        results = X.compare(machine.run, ["eager", "grouped_mm"], "fp32", clock=machine.clock)
        chosen, reason = X.choose(results)
        assert chosen == want, (load_name, seed, results)
        report = {"configured": "auto", "device": "cpu", "precision": "fp32", "shape": {"tokens": 128}}
        files.add(str(X.choice_record(report | {"chosen": chosen})))
    assert len(files) == 1


def test_timing_one_after_the_other_would_have_flipped():
    """The planted machine reproduces the flip: the medians of back-to-back repeats (eager's under one load,
    grouped_mm's under another) pick differently under different load patterns."""
    picks = set()
    for load in (LOADS["busier first"], LOADS["busier later"]):
        machine = LoadedMachine({"eager": 5.8e-3, "grouped_mm": 5.2e-3}, load, 0)
        medians = {}
        for name in ("eager", "grouped_mm"):
            times = []
            for _ in range(1 + X.REPEATS):
                start = machine.clock()
                machine.run(name)
                times.append(machine.clock() - start)
            medians[name] = sorted(times[1:])[len(times[1:]) // 2]
        picks.add(min(medians, key=medians.__getitem__))
    assert picks == {"eager", "grouped_mm"}


def test_an_implementation_that_disagrees_with_eager_is_not_eligible_even_when_fastest(block):
    run = X.block_runner(block, "fp32")
    plants = {
        "off_output": lambda out, grads: (out * 1.01, grads),
        "off_gradient": lambda out, grads: (out, grads[:-1] + [grads[-1] + 0.01 * grads[-1].abs().max()]),
    }
    results = X.compare(planted(run, plants), ["eager", *plants], "fp32")
    for name in plants:
        assert not results[name]["eligible"] and "differs from eager" in results[name]["reason"], results[name]
    assert X.choose(results)[0] == "eager"


def test_a_slower_implementation_loses_and_a_clearly_faster_one_wins(block):
    run = X.block_runner(block, "fp32")
    eager_s = min(X.compare(run, ["eager"], "fp32")["eager"]["first_call_s"] for _ in range(3))

    def slow(out, grads):  # slower than eager, and within the budget of its first call
        time.sleep(max(0.01, 2 * eager_s))
        return out, grads

    results = X.compare(planted(run, {"slow": slow}), ["eager", "slow"], "fp32")
    assert results["slow"]["eligible"] and results["slow"]["median_s"] > results["eager"]["median_s"], results
    assert X.choose(results)[0] == "eager"

    def planted_rounds(eager_s, other_s):
        return {
            "eager": {"eligible": True, "rounds_s": [eager_s] * X.ROUNDS, "median_s": eager_s},
            "fast": {"eligible": True, "rounds_s": [other_s] * X.ROUNDS, "median_s": other_s},
        }

    assert X.choose(planted_rounds(0.010, 0.005))[0] == "fast"
    chosen, reason = X.choose(planted_rounds(0.010, 0.010 / (X.MIN_SPEEDUP - 0.05)))
    assert chosen == "eager" and "eager kept" in reason  # within the margin: no flip between reruns


def test_an_implementation_far_over_budget_on_its_first_call_is_dropped_unrepeated(block):
    run = X.block_runner(block, "fp32")
    calls = []

    def crawl(out, grads):
        calls.append(1)
        time.sleep(2.0)
        return out, grads

    results = X.compare(planted(run, {"crawl": crawl}), ["eager", "crawl"], "fp32")
    assert not results["crawl"]["eligible"] and "first call" in results["crawl"]["reason"]
    assert len(calls) == 1 and "median_s" not in results["crawl"]


def test_a_failing_implementation_is_not_eligible(block):
    def broken(out, grads):
        raise RuntimeError("no kernel for this dtype\nmore detail")

    results = X.compare(planted(X.block_runner(block, "fp32"), {"broken": broken}), ["eager", "broken"], "fp32")
    assert results["broken"] == {"eligible": False, "reason": "fails here: RuntimeError: no kernel for this dtype"}


V5 = pytest.mark.skipif(not compat.is_transformers_v5(), reason="experts implementations and step3p5: transformers 5")


@V5
def test_step3p5_experts_really_run_grouped_and_batched_mm_and_agree_with_eager():
    """Step3p7Experts opts out of transformers' experts implementations; moeflow's Step3p5Experts (decorated
    with use_experts_implementation) runs them, and they agree with eager at the tiny model's shape."""
    report = X.measure(auto(model_config("step3p5")), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    results = report["implementations"]
    assert report["shape"]["model_type"] == "step3p5" and report["shape"]["layer"] == 1  # layer 0 is dense
    for name in ("grouped_mm", "batched_mm"):
        assert results[name]["eligible"] and results[name]["max_relative_difference"] < 1e-5, results[name]


@V5
def test_experts_that_ignore_the_switch_are_not_eligible():
    """transformers' own Step3p7Experts take the config's implementation and silently run their loop: the
    timing sees that the implementation was never called."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    block = X.moe_block(typed(ModelSettings, model_config("step3p5")), MICRO_BATCH, SEQ_LEN, CPU)
    shipped = Step3p7Experts(block.model.config).to(CPU)
    with torch.no_grad():
        for name, param in shipped.named_parameters():
            param.copy_(getattr(block.module.experts, name))
    block.module.experts = shipped
    results = X.compare(X.block_runner(block, "fp32"), ["eager", "grouped_mm", "batched_mm"], "fp32")
    for name in ("grouped_mm", "batched_mm"):
        assert not results[name]["eligible"] and "never called" in results[name]["reason"], results[name]
    assert X.choose(results)[0] == "eager"


@V5
def test_a_model_class_that_opts_out_is_offered_eager_only_and_an_explicit_choice_is_refused(monkeypatch):
    from moeflow.families.step3p5.modeling import Step3p5ForCausalLM

    monkeypatch.setattr(Step3p5ForCausalLM, "_can_set_experts_implementation", classmethod(lambda cls: False))
    report = X.measure(auto(model_config("step3p5")), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    assert report["chosen"] == "eager"
    assert "opt out" in report["implementations"]["grouped_mm"]["reason"], report["implementations"]
    explicit = typed(ModelSettings, model_config("step3p5") | {"experts_implementation": "grouped_mm"})
    with pytest.raises(ModelError, match="'model.experts_implementation': grouped_mm cannot run for this model"):
        X.measure(explicit, MICRO_BATCH, SEQ_LEN, CPU, "fp32")


def test_the_choice_file_holds_the_choice_and_its_shape_and_no_timings():
    report = X.measure(auto(tiny_model_cfg()), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    choice = X.choice_record(report)
    assert set(choice) == {"implementation", "configured", "shape", "device", "precision"}
    assert choice["implementation"] == report["chosen"] and choice["shape"]["tokens"] == MICRO_BATCH * SEQ_LEN

    def floats(obj):
        if isinstance(obj, dict):
            return [f for v in obj.values() for f in floats(v)]
        return [obj] if isinstance(obj, float) else []

    assert not floats(choice) and "ms" not in str(choice)
    retimed = report | {"implementations": {n: r | {"median_s": 1.0} for n, r in report["implementations"].items()}}
    assert X.choice_record(retimed) == choice


def test_a_model_without_moe_layers_has_nothing_to_choose():
    report = X.measure(auto(tiny_dense_cfg()), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    assert report["chosen"] is None and report["shape"] is None and "no MoE layer" in report["reason"]
    assert X.choice_record(report)["implementation"] is None
    assert experts_choice_line(report).startswith("none (")


def test_an_explicit_setting_is_kept_and_the_measurement_still_reported():
    report = X.measure(
        typed(ModelSettings, tiny_model_cfg() | {"experts_implementation": "eager"}), MICRO_BATCH, SEQ_LEN, CPU, "fp32"
    )
    assert report["chosen"] == "eager" and report["reason"].startswith("set by model.experts_implementation")
    assert report["implementations"]["eager"]["eligible"]
    if not compat.is_transformers_v5():
        with pytest.raises(compat.UnsupportedOnStack, match="grouped_mm"):
            X.measure(
                typed(ModelSettings, tiny_model_cfg() | {"experts_implementation": "grouped_mm"}),
                MICRO_BATCH,
                SEQ_LEN,
                CPU,
                "fp32",
            )


def test_the_report_line_names_choice_reason_and_shape():
    report = X.measure(auto(tiny_model_cfg()), MICRO_BATCH, SEQ_LEN, CPU, "fp32")
    line = experts_choice_line(report)
    assert line.startswith(f"{report['chosen']}: ") and "4 experts, top-2, 128 tokens, cpu, fp32" in line


# --------------------------------------------------------------------------- the pipeline's rules


def dry_run_jobs(workdir, target: str) -> dict[str, list[list[str]]]:
    """rule -> the input lists of its jobs in a dry run of the smoke config."""
    out = snakemake(workdir, target, "--dry-run", "--cores", "2", *SMOKE).stdout
    jobs: dict[str, list[list[str]]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        head = re.match(r"(?:local)?rule (\w+):", block)
        inputs = re.search(r"^\s+input: (.*)$", block, re.MULTILINE)
        if head:
            jobs.setdefault(head.group(1), []).append(inputs.group(1).split(", ") if inputs else [])
    return jobs


def rules_that_load_a_model() -> set[str]:
    """The rules whose script builds or loads a model (from the rule files and their scripts)."""
    rules = set()
    for rule_file in (REPO_ROOT / "workflow" / "rules").glob("*.smk"):
        for block in re.split(r"\n(?=rule \w+:)", rule_file.read_text()):
            head, script = re.match(r"rule (\w+):", block), re.search(r"scripts/(\w+\.py)", block)
            if head and script:
                code = (REPO_ROOT / "workflow" / "scripts" / script.group(1)).read_text()
                if re.search(r"\b(make_model|load_model)\(", code):
                    rules.add(head.group(1))
    return rules


def test_every_rule_that_loads_a_model_takes_the_choice_and_none_the_timings(tmp_path):
    loaders = rules_that_load_a_model()
    assert {"pretrain_base", "coverage_valset", "warmup", "train_model", "evaluate_model"} <= loaders
    jobs = dry_run_jobs(copy_workflow(tmp_path / "moeflow"), "evaluate")
    assert "choose_experts" in jobs and {"pretrain_base", "warmup", "train_model", "evaluate_model"} <= set(jobs)
    for rule in loaders & set(jobs):
        for inputs in jobs[rule]:
            choices = [p for p in inputs if re.fullmatch(r"results/\w+/experts/e-[0-9a-f]+/choice\.json", p)]
            assert len(choices) == 1, (rule, inputs)
    assert not [rule for rule, runs in jobs.items() for inputs in runs if any("timings.json" in p for p in inputs)]


@pytest.mark.parametrize("profile", ["slurm", "slurm-multinode"])
def test_the_slurm_profiles_time_on_the_training_rules_gpu(profile):
    resources = yaml.safe_load((REPO_ROOT / "profiles" / profile / "config.yaml").read_text())["set-resources"]
    timing, training = resources["choose_experts"], resources["train_model"]
    assert timing["gpu"] >= 1 and timing["mem_mb"] and timing["runtime"]
    assert {k: timing[k] for k in ("slurm_partition", "gpu_model")} == {
        k: training[k] for k in ("slurm_partition", "gpu_model")
    }
