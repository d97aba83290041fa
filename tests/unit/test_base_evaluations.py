"""A paper scores each base model once: runs that fine-tune one base model and evaluate it alike share its set
evaluation, lm-eval and HumanEval jobs (workflow/rules/common.smk, base_evaluation_run), checked on the embedded
default's DAG."""

from __future__ import annotations

import re
from collections import Counter

from conftest import copy_workflow, snakemake, write_overlay

BASE_RULES = ("evaluate_model", "lm_eval_task", "humaneval_generate", "humaneval_execute")


def base_jobs(workdir, *overlay: str) -> Counter:
    """(rule, task or '') -> the runs whose folders a dry run of ``paper`` scores a base model in, counted."""
    out = snakemake(workdir, "paper", "--dry-run", "--cores", "2", *overlay).stdout
    jobs = Counter()
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        head = re.match(r"(?:local)?rule (\w+):", block)
        wildcards = re.search(r"^\s+wildcards: (.*)$", block, re.MULTILINE)
        if head and head.group(1) in BASE_RULES and wildcards:
            named = dict(pair.split("=", 1) for pair in wildcards.group(1).split(", "))
            if named["model"] == "base":
                jobs[(head.group(1), named.get("task", ""), named["run"])] += 1
    return jobs


def test_a_paper_scores_each_base_model_once(tmp_path):
    workdir = copy_workflow(tmp_path / "moeflow")
    humaneval_on = write_overlay(workdir, {"evaluate": {"humaneval": {"enabled": True}}})  # off in the default
    jobs = base_jobs(workdir, "--configfile", humaneval_on)
    # moe, lora and esft fine-tune one base model (scored in moe's folder), dense its own, and moe-seed2 (moe with
    # another seed, for the paper's seed noise: its base model is pretrained with that seed) its own
    assert {run for _, _, run in jobs} == {"moe", "dense", "moe-seed2"} and set(jobs.values()) == {1}
    tasks = {task for rule, task, _ in jobs if rule == "lm_eval_task"}
    bases = {run for _, _, run in jobs}
    assert tasks and len(jobs) == len(bases) * (1 + len(tasks) + 2)  # evaluate_model, each task, HumanEval's two

    # a run that samples HumanEval otherwise has its own base HumanEval jobs, and still shares the lm-eval ones
    overlay = write_overlay(
        workdir,
        {
            "evaluate": {"humaneval": {"enabled": True}},
            "runs": {"lora": {"evaluate": {"humaneval": {"temperature": 0.7}}}},
        },
    )
    jobs = base_jobs(workdir, "--configfile", overlay)
    assert {run for rule, _, run in jobs if rule.startswith("humaneval")} == {"moe", "dense", "lora", "moe-seed2"}
    assert {run for rule, _, run in jobs if rule in ("evaluate_model", "lm_eval_task")} == {"moe", "dense", "moe-seed2"}
