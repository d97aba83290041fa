"""What differs between the two supported stacks (torch 2.3 + transformers 4.57, and torch 2.6+ + transformers 5).

Every stack-dependent branch in the package asks these functions instead of parsing versions itself. They read
the installed versions, which the stack fixes (every result lives under results/<stack>), and compute nothing:
moeflow.workflow.rule_code's ``PLUMBING`` says why an edit here reruns no stage. Code that computes on what the
stack provides lives with its concern (moeflow.parallel.dtensors, moeflow.model.activation_checkpointing).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
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


def fsdp2_available() -> bool:
    """Whether moeflow shards with FSDP2 (``fully_shard``): torch >= 2.6 (the current stack). torch 2.3's early
    ``fully_shard`` needs CUDA, so the pinned stack uses FSDP1 on every device, one code path there. Read from
    the installed version, without importing torch: the memory planner asks at DAG build time."""
    return version_of("torch").release[:2] >= (2, 6)


def torch_has_muon() -> bool:
    """Whether torch ships ``torch.optim.Muon`` (torch >= 2.9: the current stack), read from the installed version
    without importing torch (config check)."""
    return version_of("torch").release[:2] >= (2, 9)


# transformers 4.57's generation code imports scikit-learn at import when it is installed (lm-eval brings it), for
# one option of assisted generation (a confidence threshold) that moeflow never uses: 1-5 s of every job that
# imports transformers on the pinned stack. transformers 5 imports it where that option runs.
SKLEARN_FLAG_MODULE = "transformers.utils.import_utils"


def _without_sklearn(module: object) -> None:
    if version_of("transformers") is not None and version_of("transformers").major < 5:
        module._sklearn_available = False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` is executed, the first time it is imported."""

    def __init__(self, name: str, then: Callable[[object], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module):
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def skip_transformers_sklearn_import() -> None:
    """Keep transformers 4.57 from importing scikit-learn (lm-eval imports it itself where a metric needs it);
    called once per process by ``moeflow/__init__.py``, before anything imports transformers."""
    if SKLEARN_FLAG_MODULE in sys.modules:
        _without_sklearn(sys.modules[SKLEARN_FLAG_MODULE])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(SKLEARN_FLAG_MODULE, _without_sklearn))
