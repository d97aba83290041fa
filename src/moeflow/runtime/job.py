"""The job a stage script runs: its rule, inputs, outputs, params, threads, log and typed settings.

The job a stage script runs: its rule, named inputs, outputs and params, threads, log file and typed
settings. A ``script:`` rule's ``snakemake`` object becomes one with :meth:`Job.from_snakemake`; a training
script that a ``shell:`` rule starts through torchrun reads its own with :meth:`Job.from_argv`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeflow.settings import typed


class Named(dict):
    """A job's named inputs, outputs or params, read as attributes too (``job.input.model``), as Snakemake's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class Job:
    """One job of a rule. ``settings``: ``params.settings`` as the stage's typed settings class (None when
    the script reads its params itself). ``log_file``: where this process logs (None: stderr only)."""

    rule: str
    input: Named
    output: Named
    params: Named
    threads: int
    log_file: str | None
    settings: Any = None

    @classmethod
    def from_argv(cls, settings: type | None = None, argv: Sequence[str] | None = None) -> Job:
        """The job a training rule passes its torchrun script: ``--job`` (JSON: rule, input, output, params,
        moeflow.workflow's ``torchrun_job``), ``--threads`` and ``--log-file``. Under torchrun the rule's threads
        are shared by the node's ranks (``threads // LOCAL_WORLD_SIZE``), and only rank 0 writes the log file
        (the other ranks log to stderr)."""
        parser = argparse.ArgumentParser(description="a moeflow training stage (started by its Snakemake rule)")
        parser.add_argument("--job", required=True, help="JSON with rule, input, output and params")
        parser.add_argument("--threads", type=int, required=True)
        parser.add_argument("--log-file", default=None)
        args = parser.parse_args(argv)
        job = json.loads(args.job)
        return cls(
            rule=job["rule"],
            input=Named(job["input"]),
            output=Named(job["output"]),
            params=Named(job["params"]),
            threads=max(1, args.threads // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
            log_file=args.log_file if int(os.environ.get("RANK", "0")) == 0 else None,
            settings=_typed_settings(settings, job["params"]),
        )

    @classmethod
    def from_snakemake(cls, smk: Any, settings: type | None = None) -> Job:
        """The job of a ``script:`` rule, from the ``snakemake`` object Snakemake gives its script (named
        inputs, outputs and params; positional ones stay on ``smk``)."""
        params = Named(smk.params.items())
        return cls(
            rule=smk.rule,
            input=Named(smk.input.items()),
            output=Named(smk.output.items()),
            params=params,
            threads=int(smk.threads),
            log_file=smk.log[0] if len(smk.log) else None,
            settings=_typed_settings(settings, params),
        )


def _typed_settings(settings: type | None, params: Mapping[str, Any]) -> Any:
    return typed(settings, params["settings"]) if settings else None
