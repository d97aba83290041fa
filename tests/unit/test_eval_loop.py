"""Evaluation batches shared out over ranks, and the ranks' sums added up."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_training import packed_rows

from moeflow.evaluation.loop import FILLER, SetStats, batches, sum_stats


@pytest.mark.parametrize("rows, world", [(5, 2), (7, 3), (1, 2), (8, 2)])
def test_every_row_is_evaluated_once_and_every_rank_runs_as_many_forwards(rows, world):
    data = packed_rows(rows)
    shards = [list(batches(data, 2, "sdpa", rank=r, world=world)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # a sharded model's forward is a collective
    counted = [b for s in shards for b in s if FILLER not in b]
    seen = sorted(tuple(row) for b in counted for row in b["input_ids"].tolist())
    assert seen == sorted(tuple(r["input_ids"]) for r in data)


def test_one_rank_gets_the_unsharded_batches():
    data = packed_rows(5)
    one, sharded = list(batches(data, 2, "sdpa")), list(batches(data, 2, "sdpa", rank=0, world=1))
    assert len(one) == 3 and all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(one, sharded))


def test_the_ranks_sums_add_up():
    def part(loss, tokens, routed):
        s = SetStats(loss_sum=loss, label_tokens=tokens, sequences=1, input_tokens=tokens + 1, seconds=tokens)
        s.add_routing([0], np.array([routed]), np.array([[loss, 0.0]]), np.array([[tokens, 0]]))
        return s

    total = sum_stats([part(2.0, 4, [3, 1]), SetStats(), part(1.0, 2, [0, 2])])
    assert (total.loss_sum, total.label_tokens, total.sequences, total.input_tokens) == (3.0, 6, 2, 8)
    assert total.routed.tolist() == [[3, 3]] and total.served_label_tokens.tolist() == [[6, 0]]
    assert total.seconds == 4 and total.loss == 0.5
