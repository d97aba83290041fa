"""The module map of docs/architecture.md: every module of src/moeflow, its dotted name and the first line of its
docstring.

The docstrings are read with ``ast`` (nothing is imported, so no torch). tests/unit/test_architecture.py checks
that every module has a docstring whose first line says what it is, and that docs/architecture.md shows this
table. Rewrite the docs' table after adding a module or changing a docstring's first line:
``python tests/module_map.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "moeflow"
DOCS = ROOT / "docs" / "architecture.md"
TABLE_START = "<!-- module map: written by tests/module_map.py -->"
TABLE_END = "<!-- end of the module map -->"


def dotted_name(path: Path) -> str:
    """``src/moeflow/train/trainer.py`` -> ``moeflow.train.trainer``; a package is its ``__init__.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[Path]:
    """Every module of the package, packages before their modules, in dotted-name order."""
    return sorted(PACKAGE.rglob("*.py"), key=lambda p: dotted_name(p).split("."))


def docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))


def summary(path: Path) -> str:
    """The first line of the module's docstring; a missing docstring raises, naming the file."""
    text = docstring(path)
    if not text or not text.strip():
        raise ValueError(f"{path.relative_to(ROOT)} has no docstring: write one whose first line says what it is")
    return text.splitlines()[0].strip()


def cell(text: str) -> str:
    """``text`` as one Markdown table cell: reST roles and double backquotes as Markdown code, ``|`` escaped."""
    return re.sub(r":(?:func|class|meth|mod|attr):`", "`", text).replace("``", "`").replace("|", "\\|")


def table() -> str:
    """The Markdown table of docs/architecture.md's module map."""
    lines = ["| module | what it is |", "|---|---|"]
    lines += [f"| `{dotted_name(p)}` | {cell(summary(p))} |" for p in modules()]
    return "\n".join(lines)


def with_table(doc: str) -> str:
    """``doc`` with the text between the module map's markers replaced by :func:`table`."""
    head, rest = doc.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":
    DOCS.write_text(with_table(DOCS.read_text(encoding="utf-8")), encoding="utf-8")
