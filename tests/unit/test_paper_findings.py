"""The paper reads as a result: each difference its comparison tables show is set against the seed noise of a
reseeded twin of the MoE run (paper.noise_run), which is no row of its own, and every caption ends with the finding
of its numbers, written from hand-made metrics here so that each number in the text can be checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moeflow.paper.build import (
    PaperStage,
    comparison_table,
    drift_table,
    forgetting_table,
    humaneval_table,
    lm_eval_table,
    method_table,
    methods_table,
    write_paper,
)
from moeflow.paper.eval_results import RunResults
from moeflow.paper.inputs import RunRecord, TrainLog
from moeflow.paper.noise import NOT_MEASURED, SeedNoise, seed_noise_table
from moeflow.paper.tables import as_dict_rows

NOISE_RUN = "moe-seed2"


def loss_set(name: str, before: float, change: float) -> dict:
    """One set of metrics.json as the paper reads it: the base and the fine-tuned loss and the change."""
    return {
        "name": name,
        "targeted": name != "test/general",
        "base": {"loss": before},
        "finetuned": {"loss": before + change},
        "change": {"loss": change},
        "forgetting": name == "test/general" and change > 0,
    }


def record(
    run: str, method: str, gain: float, forgetting: float, val_loss: float, trainable: int, total: int = 1000
) -> RunRecord:
    """A run whose fine-tune lowered the target slice's test loss by ``gain`` and moved the general slice's by
    ``forgetting``, with ``val_loss`` on the validation set at the end; an MoE run (it has routing drift)."""
    log = TrainLog(
        steps=[1, 2],
        tokens=[100, 200],
        loss=[3.0, 2.0],
        ce=[3.0, 2.0],
        lr=[1e-3, 1e-4],
        tokens_per_s=[1000.0, 1000.0],
        step_seconds=[0.5, 0.5],
        memory_mib=[10.0, 10.0],
        loads=[[[1, 1]], [[1, 1]]],
        val_steps=[2],
        val_tokens=[200],
        val_loss=[val_loss],
    )
    metrics = {
        "sets": [
            loss_set("valset", val_loss + 0.1, -0.1),
            loss_set("test/general", 4.0, forgetting),
            loss_set("test/target", 3.0, -gain),
        ],
        "parameters": {"total": total, "active_per_token": total // 2},
    }
    drift = {"tokens": 8, "layers": [{"js_divergence": 0.01, "changed_expert_set_fraction": 0.1}]}
    return RunRecord(
        name=run,
        metrics=metrics,
        speed={"finetuned": {"tokens_per_s": 2000.0}, "peak_memory_bytes": 2**20},
        log=log,
        benchmark={"max_rss_mib": 100.0},
        training={"method": method, "trainable": trainable, "total": total, "trainable_fraction": trainable / total},
        results=RunResults("general", "target", drift=drift),
        summary={"optimizer_state_bytes": 8 * trainable},
    )


# moe: gain 0.29; its reseeded twin 0.28 (the noise: 0.01); lora 0.07 (24% of it, beyond the noise); esft 0.285
# (within the noise). moe's general slice forgot 0.05, the twin's 0.03 (noise 0.02), esft's 0.02 (40% of moe's).
RUNS = {
    "moe": ("full", 0.29, 0.05, 5.99, 1000),
    NOISE_RUN: ("full", 0.28, 0.03, 6.02, 1000),
    "lora": ("lora", 0.07, 0.001, 6.30, 40),
    "esft": ("esft", 0.285, 0.02, 6.00, 60),
}


def records(*runs: str) -> list[RunRecord]:
    return [record(run, *RUNS[run]) for run in runs]


def noise() -> SeedNoise:
    return SeedNoise("moe", NOISE_RUN, (1234, 1235), record(NOISE_RUN, *RUNS[NOISE_RUN]))


def finding(caption: str) -> str:
    return caption[caption.index("Finding: ") :]


def test_the_methods_finding_sets_each_share_of_the_gain_against_the_seed_noise():
    table = methods_table(records("moe", "lora", "esft", NOISE_RUN), "moe", noise())
    assert finding(table.caption) == (
        "Finding: lora trains 4% of the parameters and keeps 24% of moe's (full) target gain (0.07 vs 0.29 "
        "nats/token, beyond the seed noise of 0.01), with 2% of its forgetting (+0.001 vs +0.05, beyond the seed "
        "noise of 0.02); esft trains 6% of the parameters and keeps 98% of moe's (full) target gain (0.28 vs 0.29 "
        "nats/token, within the seed noise of 0.01), with 40% of its forgetting (+0.02 vs +0.05, beyond the seed "
        "noise of 0.02)."
    )
    assert "moe (seed 1234) against moe-seed2 (seed 1235)" in table.caption


def test_the_noise_run_is_no_row_of_the_comparisons_but_its_distance_from_the_moe_run_is():
    runs = records("moe", "lora", "esft", NOISE_RUN)
    methods = as_dict_rows(methods_table(runs, "moe", noise()))
    assert [(r["run"], r["method"]) for r in methods] == [
        ("moe", "full"),  # one full row: the twin is no method of its own
        ("lora", "lora"),
        ("esft", "esft"),
        ("seed noise: moe vs moe-seed2", ""),
        ("lora - moe", ""),
        ("lora - moe beyond seed noise", ""),
        ("esft - moe", ""),
        ("esft - moe beyond seed noise", ""),
    ]
    noise_row, lora, lora_beyond, esft, esft_beyond = methods[3:]
    assert noise_row["target gain"] == "0.0100" and noise_row["general forgetting"] == "0.0200"
    assert lora["target gain"] == "-0.2200" and lora_beyond["target gain"] == "yes"
    assert esft["target gain"] == "-0.0050" and esft_beyond["target gain"] == "no"
    assert esft_beyond["general forgetting"] == "yes"  # 0.03 from moe's, beyond 0.02
    assert noise_row["trainable params"] == "" and lora_beyond["step s"] == ""  # no noise of a cost
    for table in (method_table(runs, "moe", noise()), forgetting_table(runs, noise())):
        assert NOISE_RUN not in [r["run"] for r in as_dict_rows(table)], table.name
    forgetting = {r["run"]: r for r in as_dict_rows(forgetting_table(runs, noise()))}
    assert forgetting["moe"]["general change beyond seed noise"] == "yes"  # +0.05 against 0.02
    assert forgetting["lora"]["general change beyond seed noise"] == "no"  # +0.001
    assert forgetting["seed noise: moe vs moe-seed2"]["general loss change"] == "0.0200"


def test_the_moe_vs_dense_finding_and_rows_state_the_difference_against_the_noise():
    moe = record("moe", *RUNS["moe"])
    dense = dataclasses.replace(
        record("dense", "full", 0.27, 0.05, 6.01, 500, 500), results=RunResults("general", "target")
    )
    table = comparison_table([moe, dense], "moe", noise())
    rows = {r["run"]: r for r in as_dict_rows(table)}
    assert list(rows) == [
        "moe",
        "dense",
        "dense / moe",
        "seed noise: moe vs moe-seed2",
        "dense - moe",
        "dense - moe beyond seed noise",
    ]
    assert rows["seed noise: moe vs moe-seed2"]["val loss"] == "0.0300" and rows["dense - moe"]["val loss"] == "0.0200"
    assert rows["dense - moe beyond seed noise"]["val loss"] == "no"
    assert finding(table.caption) == (
        "Finding: moe's validation loss is 0.02 nats/token below dense's (5.990 vs 6.010, within the seed noise of "
        "0.03) and its target-slice gain 0.02 larger (0.29 vs 0.27, beyond the seed noise of 0.01)."
    )


def test_without_a_noise_run_the_captions_say_it_was_not_measured_and_how_to_measure_it():
    runs = records("moe", "lora")
    for table in (
        comparison_table(runs[:1], "moe"),
        method_table(runs, "moe"),
        methods_table(runs, "moe"),
        forgetting_table(runs),
        seed_noise_table(None, runs[0], "Finding: no rows: the seed noise was not measured."),
    ):
        assert NOT_MEASURED in table.caption and "paper.noise_run" in table.caption, table.name
        assert not [r for r in as_dict_rows(table) if "seed noise" in r[table.columns[0]]], table.name
    assert "keeps 24% of moe's (full) target gain (0.07 vs 0.29 nats/token)," in methods_table(runs, "moe").caption


def test_a_table_without_rows_says_so():
    assert finding(methods_table([], "moe").caption) == "Finding: no rows: no MoE run, so no methods to compare."
    assert finding(forgetting_table([]).caption) == "Finding: no rows: no run was evaluated."
    assert finding(drift_table([]).caption) == "Finding: no rows: no MoE run, so no routing drift."
    assert finding(lm_eval_table([]).caption).startswith("Finding: no rows: no lm-eval task was run")
    assert finding(humaneval_table([]).caption) == "Finding: no rows: no run ran HumanEval."
    one = comparison_table(records("moe"), "moe")
    assert finding(one.caption) == "Finding: no dense run to compare with moe (paper.dense_runs is empty)."


def test_the_paper_with_a_noise_run_is_byte_stable_and_names_the_noise(tmp_path):
    from test_artifacts import write_paper_inputs

    inputs = write_paper_inputs(tmp_path)
    moe = inputs["records"]["moe"]
    twin = dataclasses.replace(moe, name=NOISE_RUN, metrics={**moe.metrics, "sets": moe.metrics["sets"][::-1]})
    inputs["records"] = {**inputs["records"], NOISE_RUN: twin}
    inputs["experts"] = {run: next(iter(inputs["experts"].values())) for run in inputs["records"]}
    inputs["config"] = {**inputs["config"], "runs": {"moe": {}, "dense": {}, NOISE_RUN: {"seed": 2}}}
    inputs["settings"] = dataclasses.replace(inputs["settings"], noise_run=NOISE_RUN)
    blobs = {}
    for attempt in ("a", "b"):
        paths = write_paper(tmp_path / attempt, **inputs)
        blobs[attempt] = {Path(p).relative_to(tmp_path / attempt).as_posix(): Path(p).read_bytes() for p in paths}
    assert blobs["a"] == blobs["b"]
    seed_noise = blobs["a"]["tables/seed_noise.md"].decode()
    assert "moe (seed 1) against moe-seed2 (seed 2)" in seed_noise and "| loss after | valset |" in seed_noise
    assert "| moe-seed2 |" not in blobs["a"]["tables/forgetting.md"].decode()
    assert "| moe-seed2 |" in blobs["a"]["tables/final_metrics.md"].decode()  # its own numbers are kept there
    with pytest.raises(ValueError, match="paper.noise_run 'gone' has no results"):
        write_paper(tmp_path / "c", **{**inputs, "settings": PaperStage("moe", ("dense",), "valset", 80, "gone")})
