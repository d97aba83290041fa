"""The package's import graph: no cycles, and the rule inputs that come from it."""

from __future__ import annotations

from moeflow.settings import REPO_ROOT
from moeflow.workflow.imports import direct_imports, find_cycle, import_graph, module_path, transitive_imports

SCRIPTS = sorted((REPO_ROOT / "workflow" / "scripts").glob("*.py"))


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


# The packages bottom to top (a module at the package root, such as moeflow.settings, is a layer of its own): a
# package imports only itself and the layers below it, so no two packages import each other. The root's
# __init__ runs before any import of the package and is no layer.
LAYERS = (
    "settings",
    "runtime",
    "families",
    "data",
    "model",
    "parallel",
    "evaluation",
    "checkpoint",
    "train",
    "loading",
    "coverage",
    "plan",
    "paper",
    "stages",
    "serving",
    "workflow",
)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_packages_import_only_the_layers_below_them():
    graph = import_graph()
    layers = {layer_of(m) for m in graph} - {None}
    assert layers == set(LAYERS), "a package is missing from LAYERS, or LAYERS names one that is gone"
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(module) and layer_of(target) and LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module))
    )
    assert upward == []


def test_find_cycle_finds_one_through_imports_inside_functions(tmp_path):
    package = tmp_path / "moeflow"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def thing():\n    from moeflow import c\n")
    (package / "c.py").write_text("import moeflow.a\n")
    graph = import_graph(package)
    assert graph["moeflow.b"] == {"moeflow", "moeflow.c"}
    assert find_cycle(graph) == ["moeflow.a", "moeflow.b", "moeflow.c", "moeflow.a"]
    (package / "c.py").write_text("import json\n")
    assert find_cycle(import_graph(package)) is None


def test_direct_imports_see_every_form_of_import(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os\nfrom moeflow.parallel import gradients as G\nfrom moeflow.runtime.files import write_json\n"
        "import moeflow.runtime.stage\ndef f():\n    from moeflow.train.losses import StepLoss\n"
    )
    found = direct_imports(script)
    want = {"moeflow.parallel.gradients", "moeflow.runtime.files", "moeflow.runtime.stage", "moeflow.train.losses"}
    assert want <= found
    assert {"moeflow.parallel", "moeflow.runtime", "moeflow.train"} <= found  # the packages Python runs first
    assert not any(m in found for m in ("os", "moeflow.runtime.files.write_json", "moeflow.train.losses.StepLoss"))


def test_every_stage_script_reaches_the_package_through_its_imports():
    assert SCRIPTS
    for script in SCRIPTS:
        reached = transitive_imports(script)
        assert "moeflow" in reached and "moeflow.runtime.stage" in reached, script.name
        for module in reached:
            assert module_path(module).is_file(), (script.name, module)


def test_transitive_imports_follow_the_package(tmp_path):
    graph = import_graph()
    script = tmp_path / "s.py"
    script.write_text("from moeflow.train.trainer import Trainer\n")
    reached = set(transitive_imports(script))
    closure, todo = set(), ["moeflow.train.trainer"]
    while todo:
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo += graph[module]
    assert reached == closure | {"moeflow"}
