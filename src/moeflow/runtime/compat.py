"""What differs between the two supported stacks (torch 2.3 + transformers 4.57, and torch 2.6+ + transformers 5).

Every stack-dependent branch in the package asks these functions instead of parsing versions itself.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.version import Version


class UnsupportedOnStack(RuntimeError):
    """A feature was asked for that the installed stack does not provide."""


@functools.cache
def version_of(dist: str) -> Version | None:
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


def transformers_major() -> int:
    v = version_of("transformers")
    if v is None:
        raise UnsupportedOnStack("transformers is not installed")
    return v.major


def is_transformers_v5() -> bool:
    return transformers_major() >= 5


def require_transformers_v5(feature: str) -> None:
    """Raise a clear error where a feature exists on the current stack (transformers 5) only."""
    if not is_transformers_v5():
        raise UnsupportedOnStack(
            f"{feature} needs transformers 5 (the 'current' stack); this environment has "
            f"transformers {version_of('transformers')}. Run with STACK=current, or turn the setting off."
        )
