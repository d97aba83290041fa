"""The job a stage script runs: its rule, inputs, outputs, params, threads, log and typed settings.

A ``script:`` rule's ``snakemake`` object becomes one with :meth:`Job.from_snakemake`; a script that a
``shell:`` rule starts through torchrun reads its own with :meth:`Job.from_argv`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    the script reads its params itself). ``log_file``: where this process logs (None: stderr only). ``gpus``:
    the GPUs the stage claims when it starts (a ``script:`` rule's ``resources.gpu``; a torchrun script's
    launcher claimed them before it started)."""

    rule: str
    input: Named
    output: Named
    params: Named
    threads: int
    log_file: str | None
    settings: Any = None
    gpus: int = 0
    wildcards: Named = field(default_factory=Named)

    @classmethod
    def from_argv(cls, settings: type | None = None, argv: Sequence[str] | None = None) -> Job:
        """The job a torchrun rule passes its script (common.smk's ``TORCHRUN_SHELL``): ``--job`` (JSON: rule,
        named input and output paths, path params), ``--settings`` and ``--runtime`` (JSON: the params Snakemake
        compares), ``--threads`` and ``--log-file``. Under torchrun the rule's threads are shared by the node's
        ranks (``threads // LOCAL_WORLD_SIZE``), and only rank 0 writes the log file (the others log to stderr)."""
        parser = argparse.ArgumentParser(description="a moeflow stage that runs through torchrun (started by its rule)")
        parser.add_argument("--job", required=True, help="JSON with rule, input, output and path params")
        parser.add_argument("--settings", type=json.loads, help="JSON: the rule's settings param")
        parser.add_argument("--runtime", type=json.loads, help="JSON: the rule's runtime param")
        parser.add_argument("--threads", type=int, required=True)
        parser.add_argument("--log-file", default=None)
        args = parser.parse_args(argv)
        job = json.loads(args.job)
        compared = {name: value for name, value in (("settings", args.settings), ("runtime", args.runtime)) if value}
        params = job["params"] | compared
        return cls(
            rule=job["rule"],
            input=Named(job["input"]),
            output=Named(job["output"]),
            params=Named(params),
            threads=max(1, args.threads // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
            log_file=args.log_file if int(os.environ.get("RANK", "0")) == 0 else None,
            settings=_typed_settings(settings, params),
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
            gpus=int(getattr(getattr(smk, "resources", None), "gpu", 0) or 0),
            wildcards=Named(smk.wildcards.items()) if hasattr(smk, "wildcards") else Named(),
        )


def _typed_settings(settings: type | None, params: Mapping[str, Any]) -> Any:
    return typed(settings, params["settings"]) if settings else None
