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
from moeflow.evaluation.lm_eval_run import TaskRun, corpus_records, evaluation_options, metrics, num_samples
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
    threads: int = 1,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """lm-eval's output for ``task`` on the folder ``model_dir`` in the engine, one per run, with one engine start.

    Each run is a documents file and its token ids (:data:`moeflow.evaluation.lm_eval_run.TaskRun`); each output has
    lm-eval's ``results`` and ``n-samples``. The second value is what ran them: the engine's name, version, device
    and dtype, and lm-eval's version. ``serving``: python, dtype, timeout_s (moeflow.workflow.keys.engine_serving);
    ``settings``: ``evaluate.lm_eval``."""
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
        "options": evaluation_options(settings, seed),
        "seed": seed,
        "max_length": max_length,
        "first_token_as_context": task.docs == SEGMENTS,
    }
    args = ["--dtype", serving["dtype"]]
    record = run_engine(
        serving["python"], model_dir, args, serving["timeout_s"], threads, request=("--lm-eval", request)
    )
    engine = {"name": record["engine"], "version": record["version"], "device": record["device"]}
    return record["outputs"], engine | {"dtype": serving["dtype"], "lm_eval": record["lm_eval"]}


def engine_task_record(
    serving: Mapping[str, Any],
    model_dir: str | os.PathLike,
    task: TaskSpec,
    documents: Mapping[str, tuple[list[dict[str, Any]], list[Segment]]],
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    workdir: str | os.PathLike,
    threads: int = 1,
) -> dict[str, Any]:
    """The lm_eval_task record of ``task`` scored in the engine, with the engine under ``engine``.

    A corpus task runs on ``documents`` per corpus, as moeflow.evaluation.lm_eval_run.corpus_documents builds them;
    ``lm_eval`` is the serving environment's lm-eval version."""
    ran: dict[str, Any] = {}

    def score(runs: Sequence[TaskRun]) -> list[dict[str, Any]]:
        outputs, engine = engine_task_outputs(serving, model_dir, task, settings, max_length, seed, runs, threads)
        ran.update(engine)
        return outputs

    if task.docs:
        record = corpus_records(task, documents, workdir, score)
    else:
        (scored,) = score([(None, None)])
        record = {"metrics": metrics(scored), "num_samples": num_samples(scored)}
    return record | {"lm_eval": ran.pop("lm_eval"), "engine": ran}
