"""Which finished Snakemake runs get a report card (moeflow.workflow.report_card.card_stage), and the seed-noise and
lm-eval lines from records written here; what the card says otherwise is checked on a finished smoke pipeline's files
in tests/pipeline/test_report_card_pipeline.py."""

from __future__ import annotations

import pytest

from moeflow.workflow.report_card import card_stage


@pytest.mark.parametrize(
    ("targets", "stage"),
    [
        ((), "train"),  # no target: the default, train
        (("train",), "train"),
        (("paper",), "paper"),
        (("train", "paper"), "paper"),
        (("verify_env",), None),
        (("evaluate",), None),
        (("results/pinned/runs/moe/model",), None),
        (("train", "results/pinned/runs/moe/plan.json"), None),
    ],
)
def test_train_paper_and_the_default_target_get_a_card_and_nothing_else(targets, stage):
    assert card_stage(targets, "train") == stage


def test_no_target_and_no_default_gets_no_card():
    assert card_stage((), None) is None


def test_the_seed_noise_section_sets_each_runs_target_change_against_the_twins(tmp_path):
    import json

    from moeflow.workflow.report_card import CardFiles, RunFiles, Sources, noise_lines

    changes = {"moe": (-0.29, -0.14), "moe-seed2": (-0.27, -0.15), "lora": (-0.07, -0.01), "esft": (-0.015, 0.0)}
    runs = []
    for run, (target, general) in changes.items():
        sets = [
            {"name": "valset", "targeted": True, "change": {"loss": target}},
            {"name": "test/general", "targeted": False, "change": {"loss": general}},
            {"name": "test/target", "targeted": True, "change": {"loss": target}},
        ]
        metrics = tmp_path / run / "metrics.json"
        metrics.parent.mkdir()
        metrics.write_text(json.dumps({"run": run, "sets": sets}))
        base = str(tmp_path / run)
        runs.append(RunFiles(run, True, base, base, base, base, base, base, evaluation=str(metrics)))
    card = CardFiles("pinned", "paper", runs, str(tmp_path), noise=("moe", "moe-seed2"))
    section = "\n".join(noise_lines(card, Sources()))
    assert "test/target 0.0200" in section and "test/general 0.0100" in section
    verdicts = section.split("against the noise 0.0200: ", 1)[1].splitlines()[0]
    # the twin is the noise, not a run set against it; esft's 0.015 is within it
    assert verdicts == "`moe` -0.2900 (beyond), `lora` -0.0700 (beyond), `esft` -0.0150 (within)"
    assert noise_lines(CardFiles("pinned", "paper", runs, str(tmp_path)), Sources()) == []


def test_an_lm_eval_line_names_the_engine_that_is_not_hf(tmp_path):
    import json

    from moeflow.workflow.report_card import RunFiles, Sources, lm_eval_lines

    def card_line(engines: dict[str, str | None]) -> str:
        by_model = {}
        for model, engine in engines.items():
            path = tmp_path / f"{model}-{engine}.json"
            record = {"metrics": {"general/acc": {"value": 0.5, "stderr": None}}}
            path.write_text(json.dumps(record | ({"engine": {"name": engine}} if engine else {})))
            by_model[model] = str(path)
        base = str(tmp_path)
        run = RunFiles("moe", True, base, base, base, base, base, base, evaluation=base, lm_eval={"t": by_model})
        (line,) = lm_eval_lines(run, Sources())
        return line

    assert card_line({"base": "hf", "finetuned": None}).startswith("- lm-eval `t`, base -> fine-tuned: ")
    assert card_line({"base": "vllm", "finetuned": "vllm"}).startswith("- lm-eval `t` (through vllm), base")
    assert card_line({"base": "hf", "finetuned": "vllm"}).startswith("- lm-eval `t` (through hf and vllm), base")
