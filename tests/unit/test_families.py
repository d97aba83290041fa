"""The family conformance matrix: every supported MoE family x check on this stack, pass or refused by the
code with a clear error, exactly as docs/families.md (written by tools/family_table.py) says."""

from __future__ import annotations

from pathlib import Path

import family_checks as C
import pytest
from tiny_models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "families.md"


@pytest.fixture(scope="module")
def committed():
    return C.read_table(TABLE.read_text())


def test_the_table_covers_every_family_and_check(committed):
    assert list(committed) == [(f, c) for f in FAMILIES for c in C.CHECKS]
    assert all(set(cells) == set(C.STACKS) for cells in committed.values())


@pytest.mark.parametrize("check", list(C.CHECKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_check(family, check, committed):
    result = C.cell(C.run_check(check, family))  # a failing check raises here
    assert result == committed[(family, check)][C.stack()], "docs/families.md is out of date: run tools/family_table.py"


def test_the_readme_summary_is_the_tables(committed):
    readme = (ROOT / "README.md").read_text()
    assert C.README_START in readme and C.README_END in readme
    assert C.with_summary(readme, committed) == readme, (
        "the README's family table is out of date: run tools/family_table.py"
    )
