"""Paper artifacts: the tables hold exactly the numbers of the metrics they came from, the same inputs
give byte-identical tables and figures, and every artifact carries its provenance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from moeflow.evaluation.comparison import compare_run
from moeflow.evaluation.loop import SetStats
from moeflow.evaluation.run_metrics import EvalSet, model_record
from moeflow.paper.build import (
    PaperStage,
    balance_table,
    comparison_table,
    drift_table,
    expert_table,
    final_metrics_table,
    forgetting_table,
    humaneval_table,
    lm_eval_table,
    method_table,
    methods_table,
    paper_outputs,
    write_paper,
)
from moeflow.paper.eval_results import RunResults, read_run_results
from moeflow.paper.figures import drift_figure, expert_load_figure, loss_figure, methods_figure, save_figure
from moeflow.paper.inputs import RunRecord, read_train_log
from moeflow.paper.provenance import provenance_line, provenance_record, sha256_file, stage_provenance
from moeflow.paper.tables import TABLE_FORMATS, as_dict_rows, cell, latex_escape, read_csv_table, write_table
from moeflow.runtime.files import write_json
from moeflow.settings import with_defaults

LAYERS, EXPERTS, TOP_K = 2, 4, 2


def set_stats(seed: int, moe: bool) -> SetStats:
    rng = np.random.default_rng(seed)
    label_tokens = int(rng.integers(500, 1000))
    stats = SetStats(
        loss_sum=float(rng.uniform(2, 4)) * label_tokens,
        label_tokens=label_tokens,
        sequences=8,
        input_tokens=label_tokens + 8,
    )
    if moe:
        routed = rng.integers(0, 400, size=(LAYERS, EXPERTS))
        routed[1, 3] = 0  # a dead expert
        served = (routed * 0.9).astype(np.int64)
        stats.add_routing(list(range(LAYERS)), routed, served * rng.uniform(2, 4, size=(LAYERS, EXPERTS)), served)
    return stats


def metrics_for(run: str, moe: bool, seed: int) -> dict:
    sets = [
        EvalSet("valset", ["target", "general"], None),
        EvalSet("test/general", ["general"], None),
        EvalSet("test/target", ["target"], None),
    ]
    base = {s.name: set_stats(seed + i, moe) for i, s in enumerate(sets)}
    tuned = {s.name: set_stats(seed + 10 + i, moe) for i, s in enumerate(sets)}
    parameters = {"total": 1_000_000 if moe else 600_000, "active_per_token": 600_000}
    records = [model_record(sets, stats, None, parameters) for stats in (base, tuned)]
    return compare_run(run, *records, "target")


def train_log(path: Path, moe: bool, steps: int = 12, step_seconds: float = 0.25) -> Path:
    """A metrics.jsonl as training writes it (``moeflow.train.metrics.MetricsLog``); step ``s`` takes
    ``step_seconds x (1 + (s % 3) / 10)``."""
    from moeflow.evaluation.routing_stats import layer_health
    from moeflow.train.metrics import MetricsLog

    log = MetricsLog(path)
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        loads = rng.integers(50, 150, size=(LAYERS, EXPERTS)).tolist() if moe else []
        log.write(
            {
                "kind": "train",
                "step": step,
                "lr": 1e-3 * min(1.0, step / 4),
                "loss": 5.0 / step**0.3,
                "ce": 4.9 / step**0.3,
                "tokens": 2048,
                "seconds": step_seconds * (1 + (step % 3) / 10),
                "tokens_per_s": 9000.0 if moe else 12000.0,
                "memory_mib": 400.0 + step,
                "label_tokens": 2000,
                "routing": [layer_health(load) for load in loads],
            }
        )
        if step % 4 == 0:
            log.write(
                {
                    "kind": "eval",
                    "step": step,
                    "loss": 5.0 / step**0.25,
                    "perplexity": math.exp(5.0 / step**0.25),
                    "label_tokens": 999,
                }
            )
    log.close()
    return path / "metrics.jsonl"


def test_final_metrics_table_matches_the_metrics(tmp_path):
    evals = {"moe": metrics_for("moe", True, 0), "dense": metrics_for("dense", False, 100)}
    table = final_metrics_table(evals)
    write_table(table, tmp_path, "provenance test")
    columns, rows = read_csv_table(tmp_path / "final_metrics.csv")
    assert len(rows) == 6
    for row in (dict(zip(columns, r)) for r in rows):
        s = next(x for x in evals[row["run"]]["sets"] if x["name"] == row["set"])
        assert float(row["base loss"]) == pytest.approx(s["base"]["loss"], abs=5e-5)
        assert float(row["fine-tuned loss"]) == pytest.approx(s["finetuned"]["loss"], abs=5e-5)
        assert float(row["change"]) == pytest.approx(s["finetuned"]["loss"] - s["base"]["loss"], abs=5e-5)
        assert float(row["fine-tuned ppl"]) == pytest.approx(math.exp(s["finetuned"]["loss"]), abs=5e-3)  # 2 decimals
        assert row["targeted"] == ("yes" if "target" in s["corpora"] else "no")
        assert row["forgetting"] == ("yes" if row["targeted"] == "no" and float(row["change"]) > 0 else "no")
    md = (tmp_path / "final_metrics.md").read_text()
    tex = (tmp_path / "final_metrics.tex").read_text()
    for r in rows:  # the same digits in every format
        assert "| " + " | ".join(r) + " |" in md
        assert " & ".join(latex_escape(c) for c in r) + " \\\\" in tex


def test_expert_and_balance_tables_match_the_metrics():
    evals = {"moe": metrics_for("moe", True, 0), "dense": metrics_for("dense", False, 100)}
    experts = as_dict_rows(expert_table(evals))
    assert len(experts) == LAYERS * EXPERTS  # the dense run has no experts
    valset = evals["moe"]["sets"][0]
    for row in experts:
        layer, e = int(row["layer"]), int(row["expert"])
        assert float(row["base share"]) == pytest.approx(valset["base"]["experts"][layer]["share"][e], abs=5e-5)
        expected = valset["finetuned"]["experts"][layer]["mean_loss"][e]
        if expected is None:  # the dead expert served no token
            assert (layer, e) == (1, 3) and row["fine-tuned loss"] == "n/a"
        else:
            assert float(row["fine-tuned loss"]) == pytest.approx(expected, abs=5e-5)
    balance = as_dict_rows(balance_table(evals))
    dead = {(r["layer"], r["model"]): int(r["dead experts"]) for r in balance}
    assert dead[("1", "base")] == 1 and dead[("1", "finetuned")] == 1 and dead[("0", "base")] == 0


def test_tables_are_byte_identical_for_the_same_inputs(tmp_path):
    for attempt in ("a", "b"):
        evals = {"moe": metrics_for("moe", True, 0), "dense": metrics_for("dense", False, 100)}
        write_table(final_metrics_table(evals), tmp_path / attempt, "p")
        write_table(expert_table(evals), tmp_path / attempt, "p")
    for name in ("final_metrics", "experts"):
        for ext in TABLE_FORMATS:
            assert (tmp_path / "a" / f"{name}.{ext}").read_bytes() == (tmp_path / "b" / f"{name}.{ext}").read_bytes()


def test_cells_and_latex_escaping():
    assert cell(None) == "n/a" and cell(float("nan")) == "n/a"
    assert cell(True) == "yes" and cell(3) == "3"
    assert cell(2.0) == "2.0000" and cell(2.0, 2) == "2.00"
    assert cell(1234567.0) == "1234567"
    assert latex_escape("test/general_50% & #1") == r"test/general\_50\% \& \#1"


def test_training_log_is_read_by_step_with_cumulative_tokens(tmp_path):
    log = read_train_log(train_log(tmp_path / "run", moe=True))
    assert log.steps == list(range(1, 13))
    assert log.tokens[-1] == 12 * 2048
    assert log.val_steps == [4, 8, 12] and log.val_tokens == [4 * 2048, 8 * 2048, 12 * 2048]
    assert log.is_moe and np.asarray(log.loads).shape == (12, LAYERS, EXPERTS)
    assert log.step_seconds == [0.25 * (1 + (s % 3) / 10) for s in range(1, 13)]


def test_comparison_table_reports_both_runs_and_their_ratios(tmp_path):
    records = [
        RunRecord(
            run,
            metrics_for(run, moe, seed),
            {"finetuned": {"tokens_per_s": tps}, "peak_memory_bytes": mem * 2**20},
            read_train_log(train_log(tmp_path / run, moe)),
            {"max_rss_mib": mem},
        )
        for run, moe, seed, tps, mem in (("moe", True, 0, 5000.0, 800.0), ("dense", False, 100, 10000.0, 600.0))
    ]
    rows = as_dict_rows(comparison_table(records, "moe"))
    assert [r["run"] for r in rows] == ["moe", "dense", "dense / moe"]
    assert rows[0]["train tokens/s"] == "9000" and rows[1]["train tokens/s"] == "12000"
    assert (
        rows[2]["train tokens/s"] == "1.33x"
        and rows[2]["eval tokens/s"] == "2.00x"
        and rows[2]["eval peak MiB"] == "0.75x"
    )
    assert rows[0]["total params"] == "1000000" and rows[0]["active params/token"] == "600000"
    assert float(rows[1]["val loss"]) == pytest.approx(records[1].metrics["sets"][0]["finetuned"]["loss"], abs=5e-5)


def training_report(method: str, trainable: int, total: int) -> dict:
    """adapter/trainable_parameters.json as moeflow.model.lora.save_adapter_output writes it (the fields the table
    reads)."""
    return {"method": method, "trainable": trainable, "total": total, "trainable_fraction": trainable / total}


def test_lora_vs_full_table_compares_every_run_at_the_same_tokens(tmp_path):
    full_log = read_train_log(train_log(tmp_path / "moe", moe=True, steps=12))
    lora_log = read_train_log(train_log(tmp_path / "lora", moe=True, steps=8))  # a shorter run
    lora_log.tokens_per_s = [15000.0] * len(lora_log.tokens_per_s)
    records = [
        RunRecord(
            "moe",
            metrics_for("moe", True, 0),
            {},
            full_log,
            {"max_rss_mib": 900.0},
            training_report("full", 10**6, 10**6),
        ),
        RunRecord(
            "lora",
            metrics_for("lora", True, 7),
            {},
            lora_log,
            {"max_rss_mib": 600.0},
            training_report("lora", 40_000, 1_040_000),
        ),
    ]
    rows = as_dict_rows(method_table(records, "moe"))
    assert [r["run"] for r in rows] == ["moe", "lora", "lora / moe"]
    assert [r["method"] for r in rows[:2]] == ["full", "lora"]
    assert (
        rows[1]["trainable params"] == "40000"
        and rows[1]["trainable %"] == "3.85"
        and rows[0]["trainable %"] == "100.00"
    )
    assert rows[0]["tokens compared"] == rows[1]["tokens compared"] == str(8 * 2048)
    assert float(rows[0]["train CE at tokens"]) == pytest.approx(
        full_log.ce[7], abs=5e-5
    )  # step 8, not the last step 12
    assert float(rows[0]["val loss at tokens"]) == pytest.approx(full_log.val_loss[1], abs=5e-5)  # eval at step 8
    assert rows[1]["train tokens/s"] == "15000" and rows[0]["train tokens/s"] == "9000"
    assert (
        rows[2]["trainable params"] == "0.04x"
        and rows[2]["train tokens/s"] == "1.67x"
        and rows[2]["train job peak RSS MiB"] == "0.67x"
    )
    assert rows[2]["train peak MiB"] == "0.99x"  # 408 (step 8) / 412 (step 12) MiB: each run's own peak


def test_figures_are_byte_stable_and_carry_provenance(tmp_path):
    log = read_train_log(train_log(tmp_path / "run", moe=True))
    for attempt in ("a", "b"):
        save_figure(expert_load_figure("moe", log), tmp_path / attempt, "load", "moeflow provenance xyz")
        save_figure(loss_figure({"moe": log}), tmp_path / attempt, "loss", "moeflow provenance xyz")
    for name in ("load.png", "load.pdf", "loss.png", "loss.pdf"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    from PIL import Image

    assert Image.open(tmp_path / "a" / "load.png").info["Description"] == "moeflow provenance xyz"
    assert b"moeflow provenance xyz" in (tmp_path / "a" / "loss.pdf").read_bytes()


def test_provenance_record_names_code_config_environment_and_data(tmp_path):
    env = tmp_path / "report.json"
    write_json(env, {"stack": "pinned"})
    manifest = tmp_path / "manifest.json"
    write_json(manifest, {"corpus": "general"})
    stages = stage_provenance(
        {"evaluate/moe": {"provenance": {"moeflow_code": "abc", "stage": "evaluate_run"}}, "plain": {"x": 1}}
    )
    record = provenance_record({"seed": 1}, stages, env, {"general": manifest})
    assert record["code_versions"] == ["abc"] and list(record["stages"]) == ["evaluate/moe"]
    assert record["data_manifests"]["general"] == sha256_file(manifest)[:16]
    line = provenance_line(record)
    assert record["config_hash"] in line and "abc" in line
    assert provenance_record({"seed": 2}, stages, env, {"general": manifest})["config_hash"] != record["config_hash"]


def coverage_json() -> dict:
    """coverage.json as the coverage stage writes it, from synthetic routing of 60 documents."""
    from moeflow.coverage.cover import build_constraints, coverage_report, select_documents
    from moeflow.evaluation.routing_stats import StatsCollector

    rng = np.random.default_rng(0)
    collector = StatsCollector(list(range(LAYERS)), EXPERTS, TOP_K)
    for batch in range(20):
        doc_ids = np.repeat(np.arange(batch * 3, batch * 3 + 3), 20)
        collector.add(
            0, doc_ids, [np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in doc_ids]) for _ in range(LAYERS)]
        )
    stats = collector.finish(["target"])
    settings = {"min_docs_per_expert": 3, "min_tokens": 2, "pairs_per_layer": 2, "token_budget": 400, "random_draws": 5}
    constraints = build_constraints(stats, 2, 2)
    selection = select_documents(constraints, stats.doc_tokens, stats.doc_corpus, 3, 400, seed=0)
    return coverage_report(stats, constraints, selection, settings, 0)[0]


EXPERTS_TIMINGS = {  # a choose_experts timings file (moeflow.model.experts_choice.measure)
    "configured": "auto",
    "device": "cpu",
    "precision": "fp32",
    "shape": {
        "model_type": "qwen3_moe",
        "layer": 0,
        "hidden_size": 64,
        "expert_width": 32,
        "num_experts": EXPERTS,
        "top_k": 2,
        "tokens": 256,
    },
    "implementations": {
        "eager": {"eligible": True, "median_s": 0.004, "reason": "agrees with eager (0 <= 0.0001)"},
        "batched_mm": {"eligible": False, "reason": "first call 0.05 s, over 30x the best median so far (0.002 s)"},
    },
    "chosen": "eager",
    "reason": "eager is the only eligible implementation (eager 4 ms)",
}


def write_paper_inputs(tmp_path: Path):
    env = tmp_path / "env.json"
    write_json(
        env,
        {
            "stack": "pinned",
            "system": {"python": "3.11.7"},
            "torch": {"version": "2.3.1"},
            "packages": {"transformers": "4.57.1"},
            "pins": {"matches": True},
            "provenance": {"stage": "verify_env"},
        },
    )
    manifest = tmp_path / "manifest.json"
    write_json(manifest, {"corpus": "target", "provenance": {"stage": "tokenize", "moeflow_code": "c0de"}})
    records = {
        run: RunRecord(
            run,
            metrics_for(run, moe, seed) | {"provenance": {"stage": "evaluate_run", "moeflow_code": "c0de"}},
            {"finetuned": {"tokens_per_s": tps}, "peak_memory_bytes": 700 * 2**20},
            read_train_log(train_log(tmp_path / run, moe)),
            {"max_rss_mib": 900.0},
            training_report("full", total, total),
            results_for(tmp_path, run, drift=moe),  # the dense run: lm-eval and HumanEval, no drift
        )
        for run, moe, seed, tps, total in (("moe", True, 0, 5000.0, 1_000_000), ("dense", False, 100, 9000.0, 600_000))
    }
    config = with_defaults(
        {
            "threads": 2,
            "precision": "fp32",
            "seed": 1,
            "hardware": {"device": "cpu"},
            "train": {},
            "model": {"config": {"model_type": "qwen3_moe", "num_experts": EXPERTS}},
            "data": {"seq_len": 128, "finetune_corpus": "target"},
            "runs": {"moe": {}, "dense": {}},
        }
    )
    return dict(
        config=config,
        settings=PaperStage(moe_run="moe", dense_runs=("dense",), set="valset", dpi=80),
        records=records,
        coverage=coverage_json(),
        env_report_path=env,
        manifests={"d-1/target": manifest},
        stage_docs={"evaluate/moe": records["moe"].metrics, "tokenize/target": json.loads(manifest.read_text())},
        experts={run: EXPERTS_TIMINGS for run in records},
    )


def test_write_paper_makes_every_artifact_reproducibly_with_provenance(tmp_path):
    inputs = write_paper_inputs(tmp_path)
    outputs = {}
    for attempt in ("a", "b"):
        artifacts = write_paper(tmp_path / attempt, **inputs)
        expected = set(paper_outputs(str(tmp_path / attempt)).values())
        assert {str(p) for p in artifacts} | {str(tmp_path / attempt / "provenance.json")} == expected
        outputs[attempt] = {Path(p).relative_to(tmp_path / attempt).as_posix(): Path(p).read_bytes() for p in expected}
    assert outputs["a"] == outputs["b"]  # tables, figures and provenance: byte-identical
    provenance = json.loads(outputs["a"]["provenance.json"])
    assert provenance["code_versions"] == ["c0de"]
    assert set(provenance["stages"]) == {"evaluate/moe", "tokenize/target"}
    assert provenance["artifacts"]["tables/moe_vs_dense.csv"] == sha256_file(
        tmp_path / "a" / "tables" / "moe_vs_dense.csv"
    )
    line = provenance_line({k: v for k, v in provenance.items() if k != "artifacts"})
    for name, blob in outputs["a"].items():
        if name.endswith((".csv", ".md", ".tex")):
            assert line in blob.decode(), name
    columns, rows = read_csv_table(tmp_path / "a" / "tables" / "moe_vs_dense.csv")
    assert [r[0] for r in rows] == ["moe", "dense", "dense / moe"]
    columns, rows = read_csv_table(tmp_path / "a" / "tables" / "lora_vs_full.csv")
    assert [r[:2] for r in rows] == [["moe", "full"], ["dense", "full"]]  # every run; no ratio row without a LoRA run
    columns, rows = read_csv_table(tmp_path / "a" / "tables" / "methods.csv")
    assert [r[:2] for r in rows] == [["moe", "full"]]  # the MoE run only (the dense run has no routing drift)
    columns, rows = read_csv_table(tmp_path / "a" / "tables" / "forgetting.csv")
    assert [r[0] for r in rows] == ["moe", "dense"] and "moeflow_body_choice acc change" in columns
    columns, rows = read_csv_table(tmp_path / "a" / "tables" / "routing_drift.csv")
    assert [r[:2] for r in rows] == [["moe", "0"], ["moe", "1"]]


# --------------------------------------------------------------------------- lm-eval, HumanEval, drift, forgetting
# Result files in the format the evaluation stages agree on (issue #18): lm_eval/<model>/<task>.json,
# humaneval/<model>/results.json and drift.json under runs/<run>/eval/.

TASKS = {"moeflow_perplexity": {"token_perplexity": (30.0, None)}, "moeflow_body_choice": {"acc": (0.25, 0.04)}}


def lm_eval_result(task: str, model: str, shift: float) -> dict:
    metrics = {m: {"value": v + shift, "stderr": e and e - shift / 10} for m, (v, e) in TASKS[task].items()}
    return {"task": task, "model": model, "metrics": metrics, "num_samples": 40, "provenance": {"stage": "lm_eval"}}


def humaneval_result(greedy: float, sampled: dict) -> dict:
    problems = [
        {"task_id": f"HumanEval/{i}", "greedy_passed": False, "n": 4, "correct": 0, "samples": []} for i in range(4)
    ]
    return {
        "pass_at_k": {"greedy": {"pass@1": greedy}, "sampled": sampled},
        "problems": problems,
        "settings": {"n_samples": 4},
        "provenance": {"stage": "humaneval_execute"},
    }


def drift_json() -> dict:
    """drift.json as the routing_drift stage writes it, from hand-made routings of 4 tokens."""
    from moeflow.evaluation.drift import LayerTokens, drift_record

    same = LayerTokens(1, EXPERTS, np.array([[0, 1]] * 4), 2.0)
    base = [LayerTokens(0, EXPERTS, np.array([[0, 1], [0, 1], [2, 3], [0, 2]]), 4.0), same]
    tuned = [LayerTokens(0, EXPERTS, np.array([[0, 1], [1, 3], [2, 3], [1, 2]]), 3.0), same]
    return drift_record(base, tuned) | {"provenance": {"stage": "routing_drift"}}


def write_results(root: Path, tasks=tuple(TASKS), humaneval=True, drift=True) -> dict:
    """A run's result files under ``root``; the path mapping common.smk's eval_result_files gives the paper."""
    files = {"lm_eval": {}, "humaneval": {}, "drift": None}
    for task in tasks:
        for model, shift in (("base", 0.0), ("finetuned", -0.5)):
            files["lm_eval"].setdefault(task, {})[model] = path = root / "lm_eval" / model / f"{task}.json"
            write_json(path, lm_eval_result(task, model, shift))
    if humaneval:
        for model, greedy, sampled in (
            ("base", 0.0, {"pass@1": 0.0, "pass@2": 0.1, "pass@10": 0.3}),
            ("finetuned", 0.25, {"pass@1": 0.2, "pass@2": 0.3, "pass@10": 0.6}),  # the table sorts by K, not by name
        ):
            files["humaneval"][model] = path = root / "humaneval" / model / "results.json"
            write_json(path, humaneval_result(greedy, sampled))
    if drift:
        files["drift"] = root / "drift.json"
        write_json(files["drift"], drift_json())
    return files


def results_for(tmp_path: Path, run: str, **what) -> RunResults:
    return read_run_results("general", "target", **write_results(tmp_path / run, **what))


def full_record(tmp_path: Path, run: str, moe: bool, seed: int, **what) -> RunRecord:
    """A run's record with everything the comparison tables read, and its result files (``write_results``)."""
    return RunRecord(
        run,
        metrics_for(run, moe, seed),
        {"finetuned": {"tokens_per_s": 1000.0}, "peak_memory_bytes": 2**20},
        read_train_log(train_log(tmp_path / run, moe)),
        {"max_rss_mib": 100.0},
        training_report("full", 10**6, 10**6),
        results_for(tmp_path, run, **what),
    )


def test_lm_eval_and_humaneval_tables_hold_the_result_files_numbers(tmp_path):
    record = full_record(tmp_path, "moe", True, 0)
    rows = as_dict_rows(lm_eval_table([record]))
    assert [(r["task"], r["metric"]) for r in rows] == [
        ("moeflow_perplexity", "token_perplexity"),
        ("moeflow_body_choice", "acc"),
    ]
    assert rows[0]["base"] == "30.0000" and rows[0]["fine-tuned"] == "29.5000" and rows[0]["change"] == "-0.5000"
    assert rows[0]["base stderr"] == "n/a" and rows[1]["base stderr"] == "0.0400" and rows[1]["samples"] == "40"
    assert rows[1]["fine-tuned stderr"] == "0.0900"
    rows = as_dict_rows(humaneval_table([record]))
    assert [r["measure"] for r in rows] == ["greedy pass@1", "sampled pass@1", "sampled pass@2", "sampled pass@10"]
    assert [r["change"] for r in rows] == ["0.2500", "0.2000", "0.2000", "0.3000"] and rows[0]["problems"] == "4"


def test_forgetting_table_sets_the_general_slice_beside_the_target(tmp_path):
    records = [
        full_record(tmp_path, "moe", True, 0),
        full_record(tmp_path, "dense", False, 100, tasks=(), humaneval=False, drift=False),
    ]
    table = forgetting_table(records)
    rows = as_dict_rows(table)
    assert table.columns == [
        "run",
        "general set",
        "target set",
        "general loss change",
        "target loss change",
        "moeflow_perplexity token_perplexity change",
        "moeflow_body_choice acc change",
        "HumanEval greedy pass@1 change",
        "HumanEval sampled pass@1 change",
        "HumanEval sampled pass@2 change",
        "HumanEval sampled pass@10 change",
        "forgetting",
    ]
    for row, record in zip(rows, records):
        sets = {s["name"]: s for s in record.metrics["sets"]}
        general, target = sets["test/general"]["change"]["loss"], sets["test/target"]["change"]["loss"]
        assert float(row["general loss change"]) == pytest.approx(general, abs=5e-5)
        assert float(row["target loss change"]) == pytest.approx(target, abs=5e-5)
        assert row["forgetting"] == ("yes" if general > 0 else "no")
    assert (
        rows[0]["moeflow_body_choice acc change"] == "-0.5000" and rows[0]["HumanEval greedy pass@1 change"] == "0.2500"
    )
    assert rows[1]["moeflow_body_choice acc change"] == "n/a"  # a run without the task, beside one that has it


def test_without_tasks_or_humaneval_their_columns_are_absent(tmp_path):
    records = [
        full_record(tmp_path, "moe", True, 0, tasks=(), humaneval=False),
        full_record(tmp_path, "dense", False, 100, tasks=(), humaneval=False, drift=False),
    ]
    for table in (forgetting_table(records), comparison_table(records, "moe"), method_table(records, "moe")):
        assert "general loss change" in table.columns and "target loss change" in table.columns, table.name
        assert not [c for c in table.columns if "HumanEval" in c or "moeflow_" in c], table.name
    assert lm_eval_table(records).rows == [] and humaneval_table(records).rows == []
    assert humaneval_table(records).caption.startswith("HumanEval was not run: evaluate.humaneval.enabled is off")


def test_comparison_tables_gain_the_forgetting_columns(tmp_path):
    records = [full_record(tmp_path, "moe", True, 0), full_record(tmp_path, "dense", False, 100, drift=False)]
    forgetting = {r["run"]: r for r in as_dict_rows(forgetting_table(records))}
    for table in (comparison_table(records, "moe"), method_table(records, "moe")):
        rows = as_dict_rows(table)
        for column in [c for c in forgetting_table(records).columns if c.endswith(" change")]:
            assert column in table.columns, (table.name, column)
            assert [r[column] for r in rows[:2]] == [forgetting["moe"][column], forgetting["dense"][column]]
            assert all(r[column] == "" for r in rows[2:])  # no ratios of changes


def test_drift_table_and_figure_from_drift_json(tmp_path):
    record, dense = full_record(tmp_path, "moe", True, 0), full_record(tmp_path, "dense", False, 100, drift=False)
    rows = as_dict_rows(drift_table([record, dense]))  # the dense run has no rows
    assert [(r["run"], r["layer"]) for r in rows] == [("moe", "0"), ("moe", "1")]
    # layer 0: loads (3, 2, 2, 1)/8 -> (1, 3, 2, 2)/8: expert 0 lost more than half, expert 3 doubled, expert 1
    # rose by exactly half (not more); two of four tokens changed their set
    p, q = np.array([3, 2, 2, 1]) / 8, np.array([1, 3, 2, 2]) / 8
    m = (p + q) / 2
    js = 0.5 * np.sum(p * np.log2(p / m)) + 0.5 * np.sum(q * np.log2(q / m))
    assert float(rows[0]["JS divergence"]) == pytest.approx(js, abs=5e-5)
    assert rows[0]["changed expert sets"] == "0.5000" and rows[0]["gained"] == "3" and rows[0]["lost"] == "0"
    assert rows[0]["entropy change"] == "-0.2500" and rows[0]["tokens"] == "4"
    assert rows[1]["JS divergence"] == "0.0000" and rows[1]["gained"] == rows[1]["lost"] == "none"
    for attempt in ("a", "b"):
        save_figure(drift_figure([record, dense]), tmp_path / attempt, "drift", "moeflow provenance xyz")
        save_figure(drift_figure([dense]), tmp_path / attempt, "no_drift", "moeflow provenance xyz")
    for name in ("drift.png", "drift.pdf", "no_drift.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# --------------------------------------------------------------------------- the methods comparison (issue #27)


def planted_drift(js: list[float], changed: list[float]) -> dict:
    """drift.json's fields the methods table reads: per MoE layer the JS divergence and changed expert sets."""
    return {
        "tokens": 64,
        "layers": [
            {"layer": i, "js_divergence": j, "changed_expert_set_fraction": c}
            for i, (j, c) in enumerate(zip(js, changed))
        ],
    }


METHOD_RUNS = {  # run: (method, trainable, total, optimizer state bytes, seconds per step, drift JS, changed sets)
    "moe": ("full", 1_000_000, 1_000_000, 8_000_040, 0.40, [0.02, 0.04], [0.10, 0.30]),
    "lora": ("lora", 40_000, 1_040_000, 320_040, 0.30, [0.01, 0.005], [0.05, 0.07]),
    "esft": ("esft", 250_000, 1_000_000, 2_000_016, 0.20, [0.0, 0.001], [0.0, 0.02]),
}


def method_records(tmp_path: Path, runs=tuple(METHOD_RUNS), dense: bool = True) -> list[RunRecord]:
    """Planted run outputs of the methods comparison: each run's metrics.json (its own losses per slice),
    metrics.jsonl (its own step times), trainable_parameters.json, summary.json and drift.json; plus a dense run."""
    records = []
    for i, run in enumerate(runs):
        method, trainable, total, state, seconds, js, changed = METHOD_RUNS[run]
        records.append(
            RunRecord(
                run,
                metrics_for(run, True, 20 * i),
                {},
                read_train_log(train_log(tmp_path / run, True, step_seconds=seconds)),
                {"max_rss_mib": 100.0},
                training_report(method, trainable, total),
                RunResults("general", "target", drift=planted_drift(js, changed)),
                {"optimizer_state_bytes": state},
            )
        )
    if dense:
        records.append(full_record(tmp_path, "dense", False, 100, drift=False))
    return records


def test_methods_table_holds_every_planted_number(tmp_path):
    import statistics

    records = method_records(tmp_path)
    table = methods_table(records)
    write_table(table, tmp_path / "tables", "p")
    columns, csv_rows = read_csv_table(tmp_path / "tables" / "methods.csv")
    rows = [dict(zip(columns, r)) for r in csv_rows]
    assert [(r["run"], r["method"]) for r in rows] == [("moe", "full"), ("lora", "lora"), ("esft", "esft")]
    assert "nothing to compare" not in table.caption  # three methods
    for row, record in zip(rows, records):
        method, trainable, total, state, seconds, js, changed = METHOD_RUNS[row["run"]]
        sets = {s["name"]: s for s in record.metrics["sets"]}
        target, general = sets["test/target"], sets["test/general"]
        for slice_, s in (("target", target), ("general", general)):
            assert float(row[f"{slice_} loss before"]) == pytest.approx(s["base"]["loss"], abs=5e-5)
            assert float(row[f"{slice_} loss after"]) == pytest.approx(s["finetuned"]["loss"], abs=5e-5)
        assert float(row["target gain"]) == pytest.approx(
            target["base"]["loss"] - target["finetuned"]["loss"], abs=5e-5
        )
        assert float(row["general forgetting"]) == pytest.approx(
            general["finetuned"]["loss"] - general["base"]["loss"], abs=5e-5
        )
        assert row["trainable params"] == str(trainable)
        assert row["trainable %"] == f"{100 * trainable / total:.2f}"
        assert row["optimizer state MiB"] == f"{state / 2**20:.2f}"
        planted_seconds = [seconds * (1 + (s % 3) / 10) for s in range(1, 13)]
        assert row["step s"] == f"{statistics.median(planted_seconds):.3f}"
        assert float(row["routing JS divergence"]) == pytest.approx(sum(js) / len(js), abs=5e-5)
        assert float(row["changed expert sets"]) == pytest.approx(sum(changed) / len(changed), abs=5e-5)
    # the slices differ in every planted run, so a swap of target and general cannot go unseen
    assert all(row["target loss before"] != row["general loss before"] for row in rows)
    md, tex = (tmp_path / "tables" / "methods.md").read_text(), (tmp_path / "tables" / "methods.tex").read_text()
    for r in csv_rows:
        assert "| " + " | ".join(r) + " |" in md and " & ".join(latex_escape(c) for c in r) + " \\\\" in tex


def test_methods_table_with_one_method_says_so_and_the_figure_is_stable(tmp_path):
    one = methods_table(method_records(tmp_path, runs=("moe",)))
    assert [[r["run"], r["method"]] for r in as_dict_rows(one)] == [["moe", "full"]]  # the dense run: no routing
    assert "Only one training method (full): nothing to compare" in one.caption
    none = methods_table([full_record(tmp_path, "dense", False, 100, drift=False)])
    assert none.rows == [] and "Only one training method (no MoE run)" in none.caption
    for attempt in ("a", "b"):
        records = method_records(tmp_path / attempt)
        save_figure(methods_figure(records), tmp_path / attempt, "methods", "moeflow provenance xyz")
        save_figure(methods_figure(records[:1]), tmp_path / attempt, "one", "moeflow provenance xyz")
        write_table(methods_table(records), tmp_path / attempt, "p")
    for name in ("methods.png", "methods.pdf", "one.png", "methods.csv", "methods.tex"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
