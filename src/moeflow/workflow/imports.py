"""Which moeflow modules a file imports, directly or through other moeflow modules.

Rules do not take their library inputs from this graph (they declare them by concern:
``moeflow.workflow.rule_code``); tests use it to check that every module a rule's script reaches is declared
for that rule or infrastructure, and to refuse import cycles inside the package. Files are parsed, never
imported (no torch needed).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = "moeflow"


PACKAGE_DIR = Path(__file__).resolve().parents[1]


def module_path(module: str, package_dir: Path = PACKAGE_DIR) -> Path:
    """``moeflow.train.trainer`` -> ``src/moeflow/train/trainer.py``; a package is its ``__init__.py``."""
    base = package_dir.joinpath(*module.split(".")[1:])
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """The dotted name of a package file: ``src/moeflow/train/__init__.py`` -> ``moeflow.train``."""
    parts = path.resolve().relative_to(package_dir.resolve()).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _is_package_module(module: str, package_dir: Path) -> bool:
    return module == PACKAGE or (module.startswith(PACKAGE + ".") and module_path(module, package_dir).is_file())


def direct_imports(path: str | os.PathLike, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """The moeflow modules the file at ``path`` imports anywhere in its body (also inside functions), with
    the packages Python runs on the way (``moeflow.train.trainer`` imports ``moeflow.train`` first)."""
    path = Path(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    inside = package_dir.resolve() in path.resolve().parents
    here = module_name(path, package_dir).split(".") if inside else []
    if here and path.name != "__init__.py":
        here = here[:-1]  # a module's relative imports start from its package
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if not inside or node.level > len(here):
                    continue
                base = ".".join(here[: len(here) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            # `from moeflow import distributed` imports a module; `from moeflow.x import name` does not
            found.update(f"{module}.{alias.name}" for alias in node.names)
    with_parents = set()
    for module in found:
        parts = module.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in with_parents if _is_package_module(m, package_dir)}


def used_names(path: str | os.PathLike, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """The names of moeflow modules that the file at ``path`` uses, dotted (``moeflow.runtime.files.write_json``):
    those it imports by name (``from moeflow.runtime.files import write_json``), and the attributes it reads of a
    moeflow module it imports (``from moeflow.runtime import compat`` ... ``compat.version_of``)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    names: dict[str, str] = {}  # local name -> dotted name of a module's attribute
    modules: dict[str, str] = {}  # local name -> dotted module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == PACKAGE:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                (modules if _is_package_module(dotted, package_dir) else names)[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.split(".")[0] == PACKAGE:
                    modules[alias.asname] = alias.name
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            used.add(names[node.id])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.add(f"{modules[node.value.id]}.{node.attr}")
    return used


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Every package module and the package modules it imports."""
    modules = {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    return {m: direct_imports(p, package_dir) - {m} for m, p in modules.items()}


def transitive_imports(path: str | os.PathLike, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The moeflow modules ``path`` reaches through imports, sorted; the package's ``__init__`` always
    (Python runs it before any of its modules)."""
    seen: set[str] = set()
    todo = sorted(direct_imports(path, package_dir))
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(sorted(direct_imports(module_path(module, package_dir), package_dir) - seen))
    return sorted(seen | {PACKAGE}) if seen else []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``) in ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None
