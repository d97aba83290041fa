"""Which finished Snakemake runs get a report card (moeflow.workflow.report_card.card_stage); what the card says
is checked on a finished smoke pipeline's files in tests/pipeline/test_report_card_pipeline.py."""

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
