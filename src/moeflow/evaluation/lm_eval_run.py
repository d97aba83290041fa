"""One ``evaluate.tasks`` entry through lm-evaluation-harness on a loaded model, and its result record.

The harness runs through the lm-eval package's Python API; the record is the stage's
``lm_eval/<model>/<task>.json``.

lm-eval is imported inside the functions that use it (its import takes seconds). Where it is missing the stage
refuses with :class:`HarnessUnavailable`.

moeflow's corpus tasks run once per evaluation corpus, on documents built from the corpus's packed test split
(``moeflow.evaluation.lm_eval_docs``); their metrics are named ``<corpus>/<metric>``. The perplexity task is a
cross-check of
moeflow's own evaluation, so its contexts are made the same as the evaluation's (see
:func:`continuation_scores`), and its record puts moeflow's perplexity over the same segments beside lm-eval's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from moeflow.data.shards import open_split
from moeflow.evaluation.lm_eval_docs import (
    DOCS_FILE,
    SEGMENTS,
    Segment,
    TaskDataError,
    body_choice_docs,
    document_texts,
    segment_docs,
    segments,
    write_docs,
)
from moeflow.evaluation.lm_eval_tasks import TaskSpec
from moeflow.evaluation.run_metrics import EvalSet, evaluate_model
from moeflow.parallel.layouts import generation_model
from moeflow.parallel.lockstep import forwards_in_step
from moeflow.parallel.process_group import Ranks, broadcast_object, gather_objects
from moeflow.runtime import compat

log = logging.getLogger(__name__)


class HarnessUnavailable(compat.UnsupportedOnStack):
    """lm-eval does not import on this stack."""


class HarnessError(RuntimeError):
    """lm-eval called the model in a way the cross-check cannot reproduce."""


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise HarnessUnavailable(
            f"the lm_eval stage needs the lm-eval package (pinned in envs/<stack>.yaml), which does not import "
            f"in this environment ({exc}). Install it on this stack, or leave evaluate.tasks empty here"
        ) from None


def lm_eval_version() -> str:
    return str(compat.version_of("lm_eval"))


def continuation_scores(
    model: Any,
    requests: Sequence[tuple[Any, Sequence[int], Sequence[int]]],
    batch_size: int,
    max_length: int,
    device: Any,
    first_token_as_context: int | None = None,
) -> list[tuple[float, bool]]:
    """lm-eval's ``_loglikelihood_tokens`` with the output layer applied a chunk of tokens at a time
    (``model.loss_chunk_tokens``, moeflow.model.chunked_loss): for each ``(key, context tokens, continuation
    tokens)`` request, the continuation's log-likelihood after the context and whether every continuation token is
    the model's top choice (argmax, as lm-eval's), in the requests' order. HFLM builds the whole batch's [batch,
    length, vocabulary] logits, a copy and an fp32 log-softmax of them (about 30 GB for 8 x 4,096 tokens of
    Qwen3-30B-A3B); here at most one chunk of fp32 logits exists. Requests run longest first in batches of
    ``batch_size``, right-padded, each truncated from the left to ``max_length`` + 1 tokens as HFLM does; all of
    them are the model's input (HFLM's drops the last, whose logits it does not use), so that the chunked loss
    scores the last continuation token.

    ``first_token_as_context`` (the perplexity task, given the prefix token lm-eval puts before a document):
    score a rolling window as moeflow's evaluation scores a packed segment, from its first token at position 0,
    which is context only: the window's prefix is dropped and its first token is certain (log-probability 0),
    so the sum is the segment's log-likelihood over the tokens moeflow predicts. Every window must be a whole
    document after the prefix, which a ``max_length`` of at least ``data.seq_len`` gives."""
    import torch

    from moeflow.data.shards import IGNORE_INDEX
    from moeflow.model.chunked_loss import token_losses

    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]) - len(requests[i][2]), i))
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        rows = []  # (tokens, number of continuation tokens scored)
        for i in order[start : start + batch_size]:
            _, context, continuation = requests[i]
            tokens = (list(context) + list(continuation))[-(max_length + 1) :]
            scored = min(len(continuation), len(tokens) - 1)
            if first_token_as_context is not None:
                if list(context) != [first_token_as_context]:
                    raise HarnessError(
                        "lm-eval split a perplexity document into several windows (or gave one without its prefix): "
                        "set evaluate.lm_eval.max_length to at least data.seq_len, or null"
                    )
                tokens, scored = list(continuation), len(continuation) - 1
            rows.append((tokens, scored))
        width = max(len(tokens) for tokens, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for b, (tokens, scored) in enumerate(rows):
            ids[b, : len(tokens)] = torch.tensor(tokens)
            if scored:
                labels[b, len(tokens) - scored : len(tokens)] = torch.tensor(tokens[-scored:])
        with torch.no_grad():
            scores = token_losses(model, {"input_ids": ids.to(device)}, labels)
        # position t's loss predicts token t + 1: the continuation's are the scored positions before the last
        for i, (b, (tokens, scored)) in zip(order[start : start + batch_size], enumerate(rows)):
            at = slice(len(tokens) - 1 - scored, len(tokens) - 1)
            out[i] = (-float(scores.token_loss[b, at].sum()), bool(scores.token_greedy[b, at].all()))
    return out


def chunked_lm(model: Any, tokenizer: Any, settings: Mapping[str, Any], max_length: int, first_token_as_context: bool):
    """lm-eval's HFLM on ``model`` whose log-likelihoods come from :func:`continuation_scores` (chunked logits;
    with ``first_token_as_context``, the perplexity task's scoring); generation is HFLM's own."""
    from lm_eval.models.huggingface import HFLM

    class ChunkedHFLM(HFLM):
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            prefix = self.prefix_token_id if first_token_as_context else None
            answers = continuation_scores(self.model, requests, self.batch_size, self.max_length, self.device, prefix)
            for (request, _, _), answer in zip(requests, answers):
                if request is not None:  # loglikelihood_rolling caches per document itself
                    self.cache_hook.add_partial("loglikelihood", request, answer)
            return answers

    return ChunkedHFLM(
        pretrained=model,
        tokenizer=tokenizer,
        backend="causal",
        batch_size=settings["batch_size"],
        max_length=max_length,
        logits_cache=False,
    )


def exact_tokens(encode: Callable[..., list[int]], token_ids: Mapping[str, Sequence[int]]) -> Callable[..., list[int]]:
    """HFLM's ``tok_encode``, except that a perplexity document's text gives back the tokens the data stage
    made for it: decoding a segment and encoding it again is not always the identity, and the cross-check
    must score the tokens moeflow's evaluation scores."""

    def tok_encode(string: str, *args, **kwargs) -> list[int]:
        ids = token_ids.get(string)
        return list(ids) if ids is not None else encode(string, *args, **kwargs)

    return tok_encode


def share_requests(lm: Any, model: Any, ranks: Ranks | None) -> None:
    """Split ``lm``'s requests over ``ranks`` (each holding its part of ``model``): rank r scores or generates
    requests r, r + world, ... in step with the others (:func:`forwards_in_step`), and every rank gets every
    result back in the requests' order. lm-eval itself sees one process (rank 0 of 1), so its evaluator runs
    unchanged on every rank and computes the one-process metrics from the same results in the same order. A
    no-op for one rank. Generation (``generate_until``) runs through :func:`generation_model` with transformers'
    own step synchronisation off (forwards_in_step pairs the ranks' forwards); sampled generation is refused on
    several ranks, since each rank would draw from its own random stream."""
    if ranks is None or ranks.world_size == 1:
        return
    import torch

    # a two-token window of the prefix token: a forward a rank with no request left pairs with the others'
    filler = torch.full((1, 2), lm.prefix_token_id, dtype=torch.long, device=lm.device)
    world = ranks.world_size

    def shared(score: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def scored(requests, *args, **kwargs):
            with forwards_in_step(model, filler):
                mine = score(requests[ranks.rank :: world], *args, **kwargs)
            out: list[Any] = [None] * len(requests)
            for rank, part in enumerate(gather_objects(mine)):
                out[rank::world] = part
            return out

        return scored

    def generated(generate_until: Callable[..., list[str]]) -> Callable[..., list[str]]:
        def shared_generation(requests, *args, **kwargs):
            if any(dict(request.args[1]).get("do_sample") for request in requests):
                raise HarnessError(
                    f"an lm-eval task of evaluate.tasks samples its generations (do_sample): on {world} ranks "
                    "(config key 'evaluate.ranks') each rank would draw from its own random stream, and the "
                    "results would not be one process's. Set evaluate.ranks: 1 for it, or greedy generation_kwargs"
                )
            with generation_model(model) as generator, _generating_through(lm, generator):
                with forwards_in_step(generator, filler):
                    mine = generate_until(requests[ranks.rank :: world], *args, **kwargs)
            out: list[str] = [""] * len(requests)
            for rank, part in enumerate(gather_objects(mine)):
                out[rank::world] = part
            return out

        return shared_generation

    lm.loglikelihood = shared(lm.loglikelihood)
    lm.loglikelihood_rolling = shared(lm.loglikelihood_rolling)
    lm.generate_until = generated(lm.generate_until)


@contextlib.contextmanager
def _generating_through(lm: Any, generator: Any) -> Iterator[None]:
    """lm-eval's HFLM generating through ``generator`` (:func:`generation_model`'s module) with transformers'
    ``synced_gpus`` off: on by default under FSDP, its per-step all-reduce would pair with another rank's
    filler announcement."""
    model, model_generate = lm._model, lm._model_generate

    def unsynced(context, max_length, stop, **generation_kwargs):
        return model_generate(context, max_length, stop, synced_gpus=False, **generation_kwargs)

    lm._model, lm._model_generate = generator, unsynced
    try:
        yield
    finally:
        lm._model, lm._model_generate = model, model_generate


def evaluation_options(settings: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` options from ``evaluate.lm_eval`` (``settings``), every seed ``seed``: the same
    for either engine (moeflow.serving.engine receives them as they are)."""
    return {
        "num_fewshot": settings["num_fewshot"],
        "limit": settings["limit"],
        "bootstrap_iters": settings["bootstrap_iters"],
        **{key: seed for key in ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")},
    }


def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: TaskSpec,
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    docs_file: str | Path | None = None,
    log_samples: bool = False,
    token_ids: Mapping[str, Sequence[int]] | None = None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` output for one task (for a corpus task, on the documents in ``docs_file``;
    with ``log_samples``, each document's scores under ``samples``; with ``token_ids``, the tokens lm-eval
    scores for those document texts; with several ``ranks`` holding the model, the requests shared among them
    by :func:`share_requests`, and the output on every rank).

    ``settings``: the config's ``evaluate.lm_eval``. lm-eval's seeds are all ``seed``. The registry is indexed
    only for a registry task; moeflow's tasks and a YAML file's folder are always on the include path.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(
        include_path=task.include_path,
        include_defaults=task.registry,
        metadata={DOCS_FILE: str(docs_file)} if docs_file else None,
    )
    lm = chunked_lm(model, tokenizer, settings, max_length, first_token_as_context=task.docs == SEGMENTS)
    if token_ids:
        lm.tok_encode = exact_tokens(lm.tok_encode, token_ids)
    share_requests(lm, model, ranks)
    output = simple_evaluate(
        model=lm,
        tasks=[task.spec],
        task_manager=manager,
        log_samples=log_samples,
        **evaluation_options(settings, seed),
    )
    if ranks is not None and ranks.world_size > 1:
        # under torchrun lm-eval returns its output on LOCAL_RANK 0 only (it takes the ranks for tensor
        # parallelism); every rank computed it, and every rank takes part in the cross-check
        output = broadcast_object(output)
    return output


def metrics(output: Mapping[str, Any], prefix: str = "") -> dict[str, dict[str, float | None]]:
    """``{name: {"value", "stderr"}}`` from lm-eval's results: ``metric`` (``metric,filter`` when a filter other
    than none made it), under ``subtask/`` when the task is a group of several; stderr None where lm-eval
    computes none."""
    results = output["results"]
    out = {}
    for name, entry in results.items():
        where = f"{name}/" if len(results) > 1 else ""
        for key, value in entry.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            stderr = entry.get(f"{metric}_stderr,{filter_name}")
            label = metric if filter_name == "none" else key
            out[f"{prefix}{where}{label}"] = {"value": _number(value), "stderr": _number(stderr)}
    return out


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def num_samples(output: Mapping[str, Any]) -> int:
    """The documents lm-eval scored (after ``limit``), over every task of the output."""
    return sum(int(n["effective"]) for n in output["n-samples"].values())


def moeflow_perplexity(
    model: Any,
    parts: Sequence[Segment],
    corpus: str,
    batch_size: int,
    precision: str,
    ranks: Ranks | None = None,
) -> dict[str, float | int]:
    """moeflow's evaluation (``moeflow.evaluation.run_metrics.evaluate_model``, its batches shared by
    ``ranks``) over the same segments lm-eval scored."""
    name = f"test/{corpus}"
    stats = evaluate_model(
        model,
        [EvalSet(name, [corpus], [p.row() for p in parts])],
        {"batch_size": batch_size, "max_sequences": None},
        precision,
        ranks,
    )[name]
    return {"perplexity": stats.perplexity, "label_tokens": stats.label_tokens}


def segment_loglikelihoods(output: Mapping[str, Any]) -> list[float]:
    """lm-eval's log-likelihood of each perplexity document, in document order (from ``log_samples``)."""
    (samples,) = output["samples"].values()
    return [float(s["token_perplexity"][0]) for s in sorted(samples, key=lambda s: s["doc_id"])]


def cross_check(
    model: Any,
    parts: Sequence[Segment],
    loglikelihoods: Sequence[float],
    corpus: str,
    batch_size: int,
    precision: str,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """lm-eval's token perplexity beside moeflow's over the segments lm-eval scored (the same tokens: see
    :func:`exact_tokens`), which must agree to rounding."""
    scored = parts[: len(loglikelihoods)]
    ours = moeflow_perplexity(model, scored, corpus, batch_size, precision, ranks)
    theirs = math.exp(-sum(loglikelihoods) / ours["label_tokens"])
    return {
        "lm_eval_token_perplexity": theirs,
        "moeflow_perplexity": ours["perplexity"],
        "relative_difference": abs(theirs / ours["perplexity"] - 1.0),
        "label_tokens": ours["label_tokens"],
        "segments": len(scored),
    }


def corpus_documents(
    task: TaskSpec,
    corpus_dirs: Mapping[str, str | Path],
    tokenizer: Any,
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
) -> dict[str, tuple[list[dict[str, Any]], list[Segment]]]:
    """A corpus task's documents per evaluation corpus (and the segments behind them, for the perplexity
    task), from each corpus's packed test split; a corpus that gives none (a split without a Python function
    with a docstring that fits, say) is left out, with a warning. Built before any model is loaded, so a task
    that no corpus gives documents for fails first."""
    out = {}
    for corpus, folder in corpus_dirs.items():
        rows = open_split(folder, "test")
        if task.docs == SEGMENTS:
            parts = segments(rows)
            docs = segment_docs(parts, tokenizer)
        else:
            parts = []
            docs = body_choice_docs(
                document_texts(rows, tokenizer),
                tokenizer,
                choices=settings["choices"],
                seed=seed,
                max_tokens=max_length,
            )
        if docs:
            out[corpus] = (docs, parts)
        else:
            log.warning("%s: the test split of corpus %s (%s) gives no documents; left out", task.spec, corpus, folder)
    if not out:
        raise TaskDataError(
            f"config key 'evaluate.tasks' entry {task.spec!r}: no test split of data.eval_corpora "
            f"({', '.join(corpus_dirs)}) gives documents for it ({task.docs}: e.g. no Python function with a "
            f"docstring whose prompt and body fit in {max_length} tokens); raise evaluate.lm_eval.max_length, "
            "evaluate on a corpus of Python code, or drop the task from evaluate.tasks"
        )
    return out


# One lm-eval run's documents file and the token ids of its documents' texts (the perplexity task), or None for each.
TaskRun = tuple[Path | None, Mapping[str, Sequence[int]] | None]


def corpus_task_record(
    model: Any,
    tokenizer: Any,
    task: TaskSpec,
    documents: Mapping[str, tuple[list[dict[str, Any]], list[Segment]]],
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    precision: str,
    workdir: str | Path,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """metrics (``<corpus>/<metric>``), num_samples and, for the perplexity task, cross_check per corpus; with
    several ``ranks`` holding the model, each scores its share (:func:`share_requests`) and every rank gets
    the record."""

    def score(runs: Sequence[TaskRun]) -> list[dict[str, Any]]:
        # the perplexity task logs its per-segment scores for the cross-check
        return [
            evaluate_task(model, tokenizer, task, settings, max_length, seed, docs, ids is not None, ids, ranks)
            for docs, ids in runs
        ]

    def check(parts: Sequence[Segment], output: Mapping[str, Any], corpus: str) -> dict[str, Any]:
        loglikelihoods = segment_loglikelihoods(output)
        return cross_check(model, parts, loglikelihoods, corpus, settings["batch_size"], precision, ranks)

    return corpus_records(task, documents, workdir, score, check) | {"lm_eval": lm_eval_version()}


def corpus_records(
    task: TaskSpec,
    documents: Mapping[str, tuple[list[dict[str, Any]], list[Segment]]],
    workdir: str | Path,
    score: Callable[[Sequence[TaskRun]], Sequence[Mapping[str, Any]]],
    check: Callable[[Sequence[Segment], Mapping[str, Any], str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A corpus task's record, whatever engine scores it.

    Each corpus's documents are written to ``workdir``; ``score`` gives lm-eval's output for every corpus (one
    :data:`TaskRun` each, in order), whose metrics are named ``<corpus>/<metric>``; for the perplexity task
    ``check(segments, output, corpus)`` per corpus (the HF engine's cross-check) goes under cross_check."""
    runs = []
    for corpus, (docs, _) in documents.items():
        docs_file = Path(workdir) / f"{corpus}.jsonl"
        write_docs(docs_file, docs)
        runs.append((docs_file, {doc["text"]: doc["input_ids"] for doc in docs} if task.docs == SEGMENTS else None))
    record: dict[str, Any] = {
        "metrics": {},
        "num_samples": 0,
        "corpora": list(documents),  # the corpora that gave documents
    }
    checks = {}
    for (corpus, (_, parts)), scored in zip(documents.items(), score(runs), strict=True):
        record["metrics"].update(metrics(scored, prefix=f"{corpus}/"))
        record["num_samples"] += num_samples(scored)
        if task.docs == SEGMENTS and check is not None:
            checks[corpus] = check(parts, scored, corpus)
    if checks:
        record["cross_check"] = checks
    return record


def task_record(
    model: Any,
    tokenizer: Any,
    task: TaskSpec,
    settings: Mapping[str, Any],
    max_length: int,
    seed: int,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    output = evaluate_task(model, tokenizer, task, settings, max_length, seed, ranks=ranks)
    return {"metrics": metrics(output), "num_samples": num_samples(output), "lm_eval": lm_eval_version()}
