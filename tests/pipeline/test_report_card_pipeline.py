"""The report card a finished run prints (moeflow.workflow.report_card, the Snakefile's onsuccess): on the
smoke pipeline its numbers are the stages' own files' (loss before and after per set, dead experts, the plan
against the measured peak), a stage a run lacks is said so, a missing file is named, and Snakemake's output of
a finished run ends with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import SMOKE, active_stack, phases_against_plan, results, snakemake

from moeflow.paper.inputs import read_train_log
from moeflow.workflow import keys
from moeflow.workflow.load import load, run_config
from moeflow.workflow.report_card import CardFiles, RunFiles, render_card, size

pytestmark = pytest.mark.pipeline
MIB = 2**20


def run_section(card: str, run: str) -> str:
    """The card's part for ``run``: from its heading to the next run's (or the paper line)."""
    return re.search(rf"^## run `{run}`.*?(?=^## run |^Paper: |^Stage logs: )", card, flags=re.M | re.S).group(0)


def table_rows(section: str) -> dict[str, list[str]]:
    """The loss table's rows by set name: targeted, base, fine-tuned, change, forgetting."""
    table = re.search(r"^\| set \|.*?(?=^$)", section, flags=re.M | re.S).group(0)
    rows = {}
    for line in table.splitlines()[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def approx_mib(text: str, mib: float) -> bool:
    """Whether the card's size (``605.0 MiB``, ``1.25 GiB``) is ``mib`` to the digits it prints."""
    value, unit = text.split()
    scale, half_digit = (1024, 0.005) if unit == "GiB" else (1, 0.05)
    return abs(float(value) - mib / scale) <= half_digit + 1e-9


def test_the_card_states_the_finished_pipelines_own_numbers(smoke_pipeline):
    res = results(smoke_pipeline)
    card = (res / "report_card.md").read_text()  # written by the fixture's own run (target paper)
    assert card.startswith(f"# moeflow report card: target `paper`, stack `{active_stack()}`")
    assert "Missing expected files" not in card
    for run in ("moe", "dense"):
        section = run_section(card, run)
        metrics = json.loads((res / "runs" / run / "eval" / "metrics.json").read_text())
        rows = table_rows(section)
        assert set(rows) == {s["name"] for s in metrics["sets"]}
        for s in metrics["sets"]:
            targeted, base, tuned, change, _ = rows[s["name"]]
            assert targeted == ("yes" if s["targeted"] else "no")
            assert float(base) == pytest.approx(s["base"]["loss"], abs=5e-5)
            assert float(tuned) == pytest.approx(s["finetuned"]["loss"], abs=5e-5)
            assert float(change) == pytest.approx(s["change"]["loss"], abs=5e-5)
        plan = json.loads((res / "runs" / run / "plan.json").read_text())
        planned = re.search(r"memory plan: (\w[\w ]*) \(worst phase (\w+)\); step ([\d.]+ \w+) per", section)
        assert planned.group(1) == plan["verdict"].replace("_", " ") and planned.group(2) == plan["worst_phase"]
        assert approx_mib(planned.group(3), plan["per_device_bytes"]["total"] / MIB)
        log = read_train_log(res / "runs" / run / "train" / "metrics.jsonl")
        peak = re.search(r"measured peak of a training step: ([\d.]+ \w+)", section).group(1)
        assert approx_mib(peak, max(log.memory_mib))
        assert f"train cross-entropy {log.ce[0]:.4f} (step {log.steps[0]}) -> {log.ce[-1]:.4f}" in section
        assert f"- model: `results/{active_stack()}/runs/{run}/model`" in section
    moe = run_section(card, "moe")
    summary = json.loads((res / "runs/moe/train/summary.json").read_text())
    layers = summary["routing"]["layers"]
    dead = re.search(r"end of training \(the guard's window\): (\d+) of (\d+) experts dead", moe)
    assert int(dead.group(1)) == sum(len(h["dead_experts"]) for h in layers)
    assert int(dead.group(2)) == sum(len(h["load"]) for h in layers)
    assert "routing gate after warmup" in moe and ": stable" in moe
    assert "a dense model (no router)" in run_section(card, "dense")
    assert f"Paper: `results/{active_stack()}/paper`" in card


def test_every_phase_of_a_run_is_measured_and_within_the_plans_tolerance(smoke_pipeline):
    """Issue #38: each phase's peak (every rank's, in warmup or train_model) within 1 +- 0.15 of the memory plan's
    figure for it, as the card prints them, on both stacks."""
    res = results(smoke_pipeline)
    card = (res / "report_card.md").read_text()
    for run in ("moe", "dense"):
        section = run_section(card, run)
        for phase, planned, peak in phases_against_plan(res / "runs" / run):
            line = f"| {phase} | {size(planned)} | {size(peak)} | {peak / planned:.2f} |"
            assert line in section, (line, section)


def smoke_run_files(workdir: Path, run: str, **changes) -> RunFiles:
    """The smoke pipeline's files of ``run`` for a ``paper`` card, as common.smk names them (``changes``
    replace fields)."""
    res = f"results/{active_stack()}"
    cfg = run_config(load(workdir / "config" / "smoke.yaml"), run)
    files = dict(
        run=run,
        moe=run == "moe",
        plan=f"{res}/runs/{run}/plan.json",
        warmup=f"{res}/warmup/{keys.warmup_key(cfg)}",
        model=f"{res}/runs/{run}/model",
        train_logs=f"{res}/runs/{run}/train",
        train_log=f"{res}/logs/train_model/{run}.log",
        train_benchmark=f"{res}/benchmarks/train_model/{run}.tsv",
        evaluation=f"{res}/runs/{run}/eval/metrics.json",
        lm_eval={},
        humaneval={m: f"{res}/runs/{run}/eval/humaneval/{m}/results.json" for m in ("base", "finetuned")},
        drift=f"{res}/runs/{run}/eval/drift.json" if run == "moe" else None,
    )
    return RunFiles(**(files | changes))


def test_a_stage_the_run_lacks_is_said_and_a_missing_file_is_named(smoke_pipeline, monkeypatch):
    monkeypatch.chdir(smoke_pipeline)  # the card's paths are the workflow's, relative to its folder
    res = f"results/{active_stack()}"
    gone = f"{res}/runs/moe/eval/drift.json.removed"
    moe = smoke_run_files(smoke_pipeline, "moe", humaneval={}, drift=gone)  # HumanEval off; a file not there
    card = render_card(CardFiles(stack=active_stack(), stage="paper", runs=[moe], logs=f"{res}/logs"))
    assert "- HumanEval: not run (evaluate.humaneval.enabled is off)" in card
    assert "- lm-eval: no tasks (evaluate.tasks is empty)" in card
    assert f"routing drift: **missing** `{gone}`" in card
    assert card.split("Missing expected files:\n", 1)[1] == f"- `{gone}`\n"
    # target train: no evaluation is expected, so none is missing
    runs = [smoke_run_files(smoke_pipeline, run, evaluation=None, drift=None) for run in ("moe", "dense")]
    card = render_card(CardFiles(stack=active_stack(), stage="train", runs=runs, logs=f"{res}/logs"))
    assert card.count("- evaluation sets: not evaluated by target `train`") == 2
    assert "HumanEval" not in card and "lm-eval" not in card and "Missing expected files" not in card
    assert "routing gate after warmup" in run_section(card, "moe")


def test_snakemakes_output_of_a_finished_train_ends_with_the_card(pipeline_copy):
    """A run with nothing to do calls no onsuccess (Snakemake returns first), so one run's fine-tune is forced:
    target train then reruns that one job and ends with the card, the same text as the file it keeps."""
    res = results(pipeline_copy).relative_to(pipeline_copy)
    proc = snakemake(pipeline_copy, "train", "--cores", "2", *SMOKE, "--forcerun", f"{res}/runs/dense/model")
    out = proc.stderr  # Snakemake's log
    assert "rule train_model:" in out and "2 of 2 steps (100%) done" in out
    kept = (pipeline_copy / res / "report_card.md").read_text()
    assert kept.startswith(f"# moeflow report card: target `train`, stack `{active_stack()}`")
    assert kept.count("- evaluation sets: not evaluated by target `train`") == 2
    assert "Missing expected files" not in kept
    done = out.index("2 of 2 steps (100%) done")
    assert out[done:].split("\n", 1)[1].startswith(kept)  # the card follows the last step
    after = out[done:].split("\n", 1)[1][len(kept) :].splitlines()
    assert after[0] == f"(kept in {res}/report_card.md)"
    assert all(line.startswith(("Complete log", "Elapsed time")) for line in after[1:])  # Snakemake's last lines
