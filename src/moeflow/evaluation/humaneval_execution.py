"""Running HumanEval's samples in the sandbox, never in this process, and how each ended.

Running HumanEval's samples: each sample's program (``moeflow.evaluation.humaneval.program``) in
moeflow.evaluation.sandbox, never in this process, and how it ended. Apart from moeflow.evaluation.humaneval so
that the generation rule does not import the sandbox: editing the sandbox reruns the execution only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moeflow.evaluation.humaneval import PASSED_MARKER, HumanEvalError, Problem, program
from moeflow.evaluation.sandbox import Limits, Outcome, run_many


def sample_status(outcome: Outcome) -> str:
    """passed; failed (an exception, a failed assertion, or an exit before the check ran); or how the sandbox
    ended it (timeout, cpu_limit, memory, output_limit, fork, write_outside, network, forbidden, killed)."""
    if outcome.status == "ok":
        return "passed" if PASSED_MARKER in outcome.stdout.splitlines()[-1:] else "failed"
    return "failed" if outcome.status == "error" else outcome.status


def error_line(outcome: Outcome) -> str | None:
    """The last line of stderr (the exception, or what the sandbox refused), at most 200 characters."""
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    return lines[-1][:200] if lines else None


def execute(
    problems: Sequence[Problem], samples: Sequence[Mapping[str, Any]], limits: Limits, threads: int
) -> list[dict[str, Any]]:
    """Run every sample's program in the sandbox, ``threads`` at a time: the samples with status and error."""
    by_id = {p.task_id: p for p in problems}
    unknown = sorted({s["task_id"] for s in samples} - set(by_id))
    if unknown:
        raise HumanEvalError(f"samples of unknown problems: {', '.join(unknown[:5])}")
    outcomes = run_many(
        [program(by_id[s["task_id"]], s["completion"]) for s in samples], limits, threads, desc="humaneval execute"
    )
    out = []
    for sample, outcome in zip(samples, outcomes):
        status = sample_status(outcome)
        out.append({**sample, "status": status, "error": None if status == "passed" else error_line(outcome)})
    return out
