"""The job of a training stage that a ``shell:`` rule starts through torchrun: rule, inputs, outputs and
params from ``--job``, the stage's typed settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from moeflow.settings import typed

log = logging.getLogger("moeflow")


class _Named(dict):
    """Snakemake-style access to a job's named inputs, outputs and params: ``job.input.model``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def job_from_argv(argv: Sequence[str] | None = None, *, settings: type | None = None) -> Any:
    """The ``snakemake`` object of a training script that a ``shell:`` rule starts through torchrun.

    The rule passes ``--job`` (JSON: rule, input, output, params), ``--threads`` and ``--log-file``; the
    result has the attributes ``Stage.from_snakemake`` and the scripts read, as a ``script:`` rule's has,
    and ``settings``: ``params.settings`` as the typed stage settings ``settings`` (moeflow.config), if given.
    Under torchrun the rule's threads are shared by the node's ranks (``threads // LOCAL_WORLD_SIZE``), and
    only rank 0 writes the log file (the other ranks log to stderr).
    """
    parser = argparse.ArgumentParser(description="a moeflow training stage (started by its Snakemake rule)")
    parser.add_argument("--job", required=True, help="JSON with rule, input, output and params")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args(argv)
    job = json.loads(args.job)
    return argparse.Namespace(
        rule=job["rule"],
        input=_Named(job["input"]),
        output=_Named(job["output"]),
        params=_Named(job["params"]),
        log=[args.log_file] if args.log_file and int(os.environ.get("RANK", "0")) == 0 else [],
        threads=max(1, args.threads // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        settings=typed(settings, job["params"]["settings"]) if settings else None,
    )
