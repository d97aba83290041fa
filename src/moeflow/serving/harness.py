"""lm-eval tasks through lm-eval's own vLLM backend in the serving environment (``evaluate.lm_eval.engine: vllm``).

The documents of moeflow's corpus tasks are built here, as for the HF engine (moeflow.evaluation.lm_eval_run), and the
serving environment's Python runs lm-eval on them with its ``vllm`` model type (moeflow.serving.engine's
``--lm-eval``). Two things the HF engine does differently from lm-eval's defaults travel with the request, so that
both engines score the same tokens: the exact token ids of each perplexity document, and the document's first token as
context. The record has the HF engine's metrics and names, without the perplexity cross-check: serve_check compares
the engine's log-probs with moeflow's on the coverage validation set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from moeflow.evaluation.lm_eval_docs import DOCS_FILE, SEGMENTS, Segment
from moeflow.evaluation.lm_eval_run import TaskRun, corpus_records, metrics, num_samples
from moeflow.evaluation.lm_eval_tasks import TaskSpec
from moeflow.serving.process import run_engine


def engine_task_outputs(
    serving: Mapping[str, Any],
    model_dir: str | os.PathLike,
    task: TaskSpec,
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    runs: Sequence[TaskRun],
) -> dict[str, Any]:
    """The engine's record for lm-eval's ``task`` on the folder ``model_dir``, once per run (documents file and token
    ids, :data:`moeflow.evaluation.lm_eval_run.TaskRun`) with one engine start: lm-eval's output of each (``results``,
    ``n-samples``) under ``outputs``, and the engine's and lm-eval's versions. ``serving``: python, dtype, timeout_s
    (moeflow.workflow.keys.engine_serving); ``settings``: ``evaluate.lm_eval``."""
    request = {
        "task": task.spec,
        "include_path": task.include_path,
        "include_defaults": task.registry,
        "runs": [
            {
                "metadata": {DOCS_FILE: str(docs_file)} if docs_file else None,
                "token_ids": {text: list(map(int, ids)) for text, ids in token_ids.items()} if token_ids else None,
            }
            for docs_file, token_ids in runs
        ],
        "num_fewshot": settings["num_fewshot"],
        "limit": settings["limit"],
        "bootstrap_iters": settings["bootstrap_iters"],
        "seed": seed,
        "max_length": max_length,
        "first_token_as_context": task.docs == SEGMENTS,
    }
    args = ["--dtype", serving["dtype"]]
    return run_engine(serving["python"], model_dir, args, serving["timeout_s"], request=("--lm-eval", request))


def engine_task_record(
    serving: Mapping[str, Any],
    model_dir: str | os.PathLike,
    task: TaskSpec,
    documents: Mapping[str, tuple[list[dict[str, Any]], list[Segment]]],
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    workdir: str | os.PathLike,
) -> dict[str, Any]:
    """The lm_eval_task record of ``task`` scored in the engine (for a corpus task, on ``documents`` per corpus as
    moeflow.evaluation.lm_eval_run.corpus_documents builds them), with the serving environment's lm-eval version
    and the engine's under ``engine``."""
    done: dict[str, Any] = {}

    def score(runs: Sequence[TaskRun]) -> list[dict[str, Any]]:
        done.update(engine_task_outputs(serving, model_dir, task, settings, max_length, seed, runs))
        return done["outputs"]

    if task.docs:
        record = corpus_records(task, documents, workdir, score)
    else:
        (scored,) = score([(None, None)])
        record = {"metrics": metrics(scored), "num_samples": num_samples(scored)}
    engine = {key: done[key] for key in ("version", "device")} | {"name": done["engine"], "dtype": serving["dtype"]}
    return record | {"lm_eval": done["lm_eval"], "engine": engine}
