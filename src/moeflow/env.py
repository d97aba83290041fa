"""Collect facts that identify the environment, and compare what is installed with the stack's pins."""

from __future__ import annotations

import hashlib
from importlib import metadata


def fingerprint() -> str:
    """A cheap hash of every installed distribution and its version (no torch import).

    Snakemake evaluates it when it builds the DAG: a package change reruns ``verify_env``.
    """
    pairs = sorted(
        f"{(dist.metadata['Name'] or '').lower()}=={dist.version}" for dist in metadata.distributions()
    )
    return hashlib.sha256("\n".join(pairs).encode()).hexdigest()[:16]
