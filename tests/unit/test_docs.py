"""The documentation as a reader meets it: a README of at most 10 KB that links every page of docs/, links that
lead somewhere, and names of moeflow code and repository paths that exist (a renamed or moved module fails here,
not in a reader's hands)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from moeflow.settings import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, REPO_ROOT / "config" / "README.md"]
MAX_README_BYTES = 10_000
# Where the docs and comments name code: every dotted ``moeflow.`` name in these must exist.
NAMING = [
    *PAGES,
    *(REPO_ROOT / "config").rglob("*.yaml"),
    *(REPO_ROOT / "profiles").rglob("*.yaml"),
    REPO_ROOT / "Snakefile",
    *(REPO_ROOT / "workflow").rglob("*.smk"),
    *(REPO_ROOT / "workflow" / "scripts").glob("*.py"),
    *(REPO_ROOT / "src" / "moeflow").rglob("*.py"),
    *(REPO_ROOT / "tests").rglob("*.py"),
    *(REPO_ROOT / "tools").glob("*.py"),
    # the scale benchmark's worker also runs the baseline commit's tree, and names its modules
    *(p for p in (REPO_ROOT / "benchmarks").glob("*.py") if p.name != "scale_worker.py"),
]
# Names of the code before commit aff0b16 that docs/architecture.md quotes as history, and file names that
# begin with "moeflow." (a profile's overlay).
NOT_CODE = {
    "moeflow.yaml",
    "moeflow.runtime.job.job_from_argv",
    "moeflow.loading.factory.resolve_stage_experts",
    "moeflow.model.loading.start_fine_tuning",
    # made-up modules: the import-graph test's tiny package, examples in comments
    "moeflow.a",
    "moeflow.b",
    "moeflow.c",
    "moeflow.x",
    "moeflow.a.b.c",
    "moeflow.runtime.compat.local_tensor",  # the boundary test's computing helper planted in infrastructure
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path of the repository named in a page's text (`tests/unit/test_docs.py`, `config/models/`).
REPO_PATH = re.compile(r"(?<![\w/.-])((?:src|tests|benchmarks|tools|workflow|config|profiles|envs|docs)/[\w./-]+)")
DOTTED = re.compile(r"\bmoeflow(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def module_names() -> dict[str, set[str]]:
    """Every module of the package (dotted name) and the names it defines or imports at any depth."""
    package = REPO_ROOT / "src" / "moeflow"
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        defined = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        names[dotted] = defined
    return names


def unknown_name(name: str, modules: dict[str, set[str]]) -> bool:
    """Whether ``moeflow.a.b.c`` is neither a module nor a name that its longest module prefix defines."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if module in modules:
            return k < len(parts) and parts[k] not in modules[module]
    return True


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {slug(h) for h in headings}


def test_the_readme_is_at_most_10_kb_and_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes (at most {MAX_README_BYTES}): move details to docs/"
    assert "make train" in text and "make test" in text and "make test-all" in text
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    assert [p.name for p in DOCS if f"docs/{p.name}" not in linked] == []


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_docs_and_comments_name_only_moeflow_code_that_exists():
    modules = module_names()
    unknown = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {name}"
        for path in NAMING
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for name in DOTTED.findall(line)
        if name not in NOT_CODE and unknown_name(name, modules)
    ]
    assert unknown == []


def test_every_repository_path_a_page_names_exists():
    missing = [
        f"{page.relative_to(REPO_ROOT)}: {path}"
        for page in PAGES
        for path in (p.rstrip("./") for p in REPO_PATH.findall(page.read_text(encoding="utf-8")))
        if not (REPO_ROOT / path).exists() and not (page.parent / path).exists()
    ]
    assert missing == []
