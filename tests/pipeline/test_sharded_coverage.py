"""The coverage stage sharded like training: ``coverage.ranks: 2`` with ``coverage.strategy: fsdp`` starts
coverage_valset through torchrun on two gloo ranks, each loading its FSDP shard of the base model from its folder
(moeflow.parallel.rank_load) and routing its share of the pool's batches; rank 0 merges the statistics, selects
and writes. Its valset, coverage.json and heatmap equal the one-rank outputs of the finished smoke pipeline, byte
for byte (the statistics are counts, merged in one process's order: moeflow.evaluation.routing_stats.merge_parts)."""

from __future__ import annotations

import pytest
from conftest import SMOKE, results, snakemake, write_overlay

pytestmark = pytest.mark.pipeline


def outputs(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_coverage_valset_on_two_fsdp_ranks_equals_one_rank(pipeline_copy):
    (coverage,) = (results(pipeline_copy) / "coverage").iterdir()  # the layout is no part of the coverage key
    one = outputs(coverage)
    assert {"coverage.json", "heatmap.png", "valset/manifest.json"} <= set(one)
    overlay = write_overlay(pipeline_copy, {"coverage": {"ranks": 2, "strategy": "fsdp"}})
    target = str(coverage.relative_to(pipeline_copy) / "coverage.json")
    done = snakemake(pipeline_copy, target, "--cores", "2", *SMOKE, overlay)
    log = done.stdout + done.stderr  # Snakemake logs to stderr
    assert "torch.distributed.run --standalone --monitor-interval 0.5 --nproc_per_node 2" in log
    assert "rule coverage_valset:" in log and "rule pretrain_base:" not in log and "rule choose_experts:" not in log
    assert outputs(coverage) == one
