"""tests/gloo_ranks.py's run_ranks: what the ranks report comes back; ranks that hang show where and fail the test
in bounded time."""

from __future__ import annotations

import time

import pytest
from gloo_ranks import run_ranks


def _reporting_rank(rank: int, base: int, results: dict) -> None:
    results[rank] = base + rank


def _hanging_rank(rank: int, results: dict) -> None:
    results[rank] = "started"
    time.sleep(600)


def test_each_rank_reports_into_the_returned_dict():
    assert run_ranks(_reporting_rank, 10, nprocs=3) == {0: 10, 1: 11, 2: 12}


def test_ranks_still_running_at_the_timeout_print_their_stacks_are_killed_and_fail_the_test(capfd):
    started = time.monotonic()
    with pytest.raises(AssertionError, match="_hanging_rank on 2 ranks still ran after 10 s: killed"):
        run_ranks(_hanging_rank, timeout_s=10)
    assert time.monotonic() - started < 60
    # where a rank was stuck; under load a rank can still be importing at the deadline (no stack to print yet)
    assert "in _hanging_rank" in capfd.readouterr().err
