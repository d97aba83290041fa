"""The evaluation stage sharded like training: ``evaluate.ranks: 2`` with ``evaluate.strategy: fsdp`` starts
evaluate_model through torchrun on two gloo ranks for the base and the fine-tuned model, each rank loading its FSDP
shard from the model's folder (moeflow.parallel.rank_load) and evaluating half the batches; the run's metrics.json
equals the one-rank result of the finished smoke pipeline (sums added in another order: 1e-9 relative). routing_drift
runs in the same layout, and its drift.json equals the one-rank record (the batches put back in order);
humaneval_generate too, and its samples.jsonl is the one-rank file byte for byte (rank 1 has no batch of the
smoke run's one greedy and one sampled batch: it runs filler forwards in step with rank 0's generation)."""

from __future__ import annotations

import json

import pytest
from conftest import SMOKE, results, snakemake, write_overlay

pytestmark = pytest.mark.pipeline


def assert_close(got, want, path="metrics"):
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for key in want:
            assert_close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), path
    else:
        assert got == want, path


def test_evaluation_on_two_fsdp_ranks_equals_one_rank(pipeline_copy):
    out = results(pipeline_copy) / "runs" / "moe" / "eval"
    one = json.loads((out / "metrics.json").read_text())
    one_drift = json.loads((out / "drift.json").read_text())
    samples = out / "humaneval" / "finetuned" / "samples.jsonl"
    one_samples = samples.read_bytes()
    # evaluation's own layout (evaluate.strategy): the trained model and its coverage set are reused
    overlay = write_overlay(pipeline_copy, {"evaluate": {"ranks": 2, "strategy": "fsdp"}})
    target = str(out.relative_to(pipeline_copy) / "metrics.json")
    drift = str(out.relative_to(pipeline_copy) / "drift.json")
    generated = str(samples.relative_to(pipeline_copy))
    done = snakemake(pipeline_copy, target, drift, generated, "--cores", "2", *SMOKE, overlay)
    log = done.stdout + done.stderr  # Snakemake logs to stderr
    assert "torch.distributed.run --standalone --monitor-interval 0.5 --nproc_per_node 2" in log
    assert (
        "rule evaluate_model:" in log
        and "rule evaluate_run:" in log
        and "rule routing_drift:" in log
        and "rule humaneval_generate:" in log
        and "rule warmup:" not in log
        and "rule train_model:" not in log
    )
    two = json.loads((out / "metrics.json").read_text())
    assert json.loads((out / "speed.json").read_text())["ranks"] == 2
    one.pop("provenance"), two.pop("provenance")
    assert_close(two, one)
    two_drift = json.loads((out / "drift.json").read_text())
    one_drift.pop("provenance"), two_drift.pop("provenance")
    # routing entropies: the sharded forward's probabilities differ from one process's in the last digits
    # (1e-9 relative on 2 FSDP2 gloo ranks); the chosen experts, loads and divergences are the same
    for layer in one_drift["layers"] + two_drift["layers"]:
        layer["entropies"] = [layer.pop(k) for k in ("entropy_base", "entropy_finetuned", "entropy_change")]
    for got, want in zip(two_drift.pop("layers"), one_drift.pop("layers")):
        assert got.pop("entropies") == pytest.approx(want.pop("entropies"), rel=1e-6, abs=1e-8)
        assert_close(got, want, "drift")
    assert two_drift == one_drift
    assert samples.read_bytes() == one_samples
