"""Tables rendered from one list of cells to CSV, Markdown and LaTeX, with the same digits in all three.

The cells are formatted once, and the same inputs give the same bytes.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.runtime.files import write_text

TABLE_FORMATS = ("csv", "md", "tex")


def cell(value: Any, digits: int = 4) -> str:
    """One table cell as text: the same string in CSV, Markdown and LaTeX.

    Floats get ``digits`` decimals (large ones fewer significant places after the point), ints and
    strings are kept, booleans are yes/no, missing values are ``n/a``.
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        if abs(value) >= 1e5:
            return f"{value:.4g}" if abs(value) >= 1e12 else f"{value:.0f}"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.{max(digits - 1, 1)}e}"
        return f"{value:.{digits}f}"
    return str(value)


@dataclass
class Table:
    """A table as formatted cells; ``rows`` may hold raw values, which ``cells`` formats."""

    name: str
    caption: str
    columns: list[str]
    rows: list[list[Any]]
    digits: dict[str, int] = field(default_factory=dict)  # per-column decimals (default 4)

    def found(self, finding: Callable[..., str], *args: Any) -> Table:
        """The table with ``finding(self, *args)``, the finding of its rows (moeflow.paper.findings), at the end of
        its caption."""
        self.caption = f"{self.caption} {finding(self, *args)}"
        return self

    def cells(self) -> list[list[str]]:
        return [[cell(v, self.digits.get(c, 4)) for c, v in zip(self.columns, row)] for row in self.rows]

    def numeric_columns(self, cells: list[list[str]]) -> list[bool]:
        """Columns whose cells are all numbers (or n/a, or ratios like 1.2x): right-aligned."""

        def is_number(text: str) -> bool:
            try:
                float(text.removesuffix("x"))
                return True
            except ValueError:
                return text in ("n/a", "")

        return [bool(cells) and all(is_number(row[i]) for row in cells) for i in range(len(self.columns))]

    def to_csv(self, provenance_line: str = "") -> str:
        buf = io.StringIO()
        if provenance_line:
            buf.write(f"# {provenance_line}\n")
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows(self.cells())
        return buf.getvalue()

    def to_markdown(self, provenance_line: str = "") -> str:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = [f"<!-- {provenance_line} -->"] if provenance_line else []
        lines += [f"**{self.caption}**", ""]
        lines.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
        cells = self.cells()
        lines.append("|" + "|".join("---:" if numeric else "---" for numeric in self.numeric_columns(cells)) + "|")
        lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"

    def to_latex(self, provenance_line: str = "") -> str:
        lines = [f"% {provenance_line}"] if provenance_line else []
        spec = "".join("r" if numeric else "l" for numeric in self.numeric_columns(self.cells()))
        lines += [
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{latex_escape(self.caption)}}}",
            f"\\label{{tab:{self.name}}}",
            f"\\begin{{tabular}}{{{spec}}}",
            "\\toprule",
            " & ".join(latex_escape(c) for c in self.columns) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in self.cells()]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def read_csv_table(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """Read a table written by ``write_table`` back (the provenance comment skipped)."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    rows = list(csv.reader(lines))
    return rows[0], rows[1:]


def write_table(table: Table, outdir: str | Path, provenance_line: str) -> list[Path]:
    """Write ``<name>.csv``, ``.md`` and ``.tex`` atomically; return the paths."""
    outdir = Path(outdir)
    renderers = {"csv": table.to_csv, "md": table.to_markdown, "tex": table.to_latex}
    paths = []
    for ext in TABLE_FORMATS:
        path = outdir / f"{table.name}.{ext}"
        write_text(path, renderers[ext](provenance_line))
        paths.append(path)
    return paths


def as_dict_rows(table: Table) -> list[dict[str, str]]:
    """The formatted rows as dicts keyed by column (what the CSV holds)."""
    return [dict(zip(table.columns, row)) for row in table.cells()]
