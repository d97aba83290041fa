"""The test tiers (docs/testing.md): tests/conftest.py marks every test under tests/pipeline ``full`` unless it is
marked ``fast``; ``make test`` deselects ``full``, ``make test-all`` runs everything."""

from __future__ import annotations

import tomllib
from pathlib import Path

import conftest
import pytest

from moeflow.settings import REPO_ROOT


class Item:
    """What the collection hook reads of a collected test: its file, its markers."""

    def __init__(self, path: Path, *markers: str):
        self.path, self.markers = path, list(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)


def test_pipeline_tests_are_full_unless_marked_fast_and_unit_tests_are_never_full():
    pipeline, unit = REPO_ROOT / "tests" / "pipeline", REPO_ROOT / "tests" / "unit"
    items = [
        Item(pipeline / "test_faults.py", "pipeline"),
        Item(pipeline / "test_reruns.py", "pipeline", "fast"),
        Item(pipeline / "sub" / "test_deeper.py"),
        Item(unit / "test_config.py"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    assert ["full" in item.markers for item in items] == [True, False, True, False]


def test_the_tiers_markers_are_registered_and_make_test_deselects_the_full_tier():
    ini = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {m.split(":")[0] for m in ini["markers"]} >= {"full", "fast", "pipeline", "slurm"}
    assert "--strict-markers" in ini["addopts"].split()  # a misspelt ``fast`` is an error, not a full-tier test
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert '$(BIN)/python -m pytest -m "not full" $(PYTEST_ARGS)' in makefile.split("\ntest: env\n", 1)[1]
    assert "make test-all" in (REPO_ROOT / ".ci" / "run").read_text()


def test_only_on_skips_on_the_other_stack():
    this = conftest.active_stack()
    other = "current" if this == "pinned" else "pinned"
    here, there = conftest.only_on(this, "why"), conftest.only_on(other, "why")
    assert isinstance(here, pytest.MarkDecorator) and here.args == (False,)
    assert there.args == (True,) and there.kwargs["reason"] == f"runs on the {other} stack only: why"


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their base name (no packages under tests/): two of one name fail collection."""
    names = [p.name for p in (REPO_ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
