"""Each rule's library inputs (moeflow.workflow.rule_code): declared by concern, covering every module its script
reaches through imports unless that module is infrastructure, so no code a stage runs goes silently stale;
and the rerun table of docs/reruns.md is tests/rerun_expectations.py's."""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import pytest
import rerun_expectations as E

from moeflow.settings import REPO_ROOT
from moeflow.workflow import rule_code as R
from moeflow.workflow.imports import direct_imports, import_graph, module_path, transitive_imports, used_names

RULE_FILES = sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk"))


def rule_blocks() -> dict[str, str]:
    """Each rule's text in workflow/rules/*.smk."""
    blocks = {}
    for smk in RULE_FILES:
        for block in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]:
            blocks[block.split(":", 1)[0]] = block
    return blocks


def rule_scripts() -> dict[str, Path]:
    """Each rule's stage script (``script:`` rules, and torchrun ``shell:`` rules through ``input.script``)."""
    scripts = {}
    for rule, block in rule_blocks().items():
        found = re.search(r"scripts/(\w+\.py)", block)
        if found:
            scripts[rule] = REPO_ROOT / "workflow" / "scripts" / found.group(1)
    return scripts


def import_chain(script: Path, module: str, graph: dict[str, set[str]]) -> list[str]:
    """The shortest chain of imports from ``script`` to ``module``."""
    parent: dict[str, str | None] = {m: None for m in direct_imports(script)}
    todo = deque(sorted(parent))
    while todo:
        current = todo.popleft()
        if current == module:
            chain = [current]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return [script.name, *reversed(chain)]
        for nxt in sorted(graph[current]):
            if nxt not in parent:
                parent[nxt] = current
                todo.append(nxt)
    raise AssertionError(f"{script.name} does not reach {module}")


def undeclared(rule: str, script: Path, graph: dict[str, set[str]]) -> list[str]:
    """The modules ``script`` reaches that are neither declared for ``rule`` nor infrastructure, with their chains."""
    declared = R.declared_modules(rule)
    return [
        " -> ".join(import_chain(script, module, graph))
        for module in transitive_imports(script)
        if module not in declared and not R.is_infrastructure(module)
    ]


def test_every_rule_with_a_stage_script_declares_its_own_code():
    scripts, blocks = rule_scripts(), rule_blocks()
    assert scripts and set(scripts) == set(R.RULES)
    for rule in scripts:
        assert re.search(rf'^\s+lib=code\("{rule}"\),$', blocks[rule], flags=re.M), f"rule {rule}: lib=code({rule!r})"


def test_every_module_a_rule_script_imports_is_declared_for_the_rule_or_infrastructure():
    graph = import_graph()
    missing = [
        f"{rule}: {chain}" for rule, script in rule_scripts().items() for chain in undeclared(rule, script, graph)
    ]
    assert not missing, (
        "a script reaches library code its rule does not declare (moeflow.workflow.rule_code): declare the "
        "concern for the rule, or move a helper imported across concerns to where it belongs:\n" + "\n".join(missing)
    )


def test_the_check_names_an_import_across_concerns(tmp_path):
    script = tmp_path / "coverage_valset.py"
    script.write_text("from moeflow.coverage.build import build_valset\nfrom moeflow.paper.tables import write_table\n")
    found = undeclared("coverage_valset", script, import_graph())
    assert found and all(chain.startswith("coverage_valset.py -> moeflow.paper") for chain in found), found
    assert "coverage_valset.py -> moeflow.paper.tables" in found


def computing_files(script: Path) -> list[Path]:
    """The code a stage computes with: its script and every moeflow module it reaches that is not infrastructure."""
    return [script, *(module_path(m) for m in transitive_imports(script) if not R.is_infrastructure(m))]


def infrastructure_calls(rule: str, script: Path) -> set[str]:
    """The names of infrastructure that the code ``rule`` computes with uses, as ``file: name``."""
    return {
        f"{path.name}: {name}"
        for path in computing_files(script)
        for name in used_names(path)
        if R.is_infrastructure(name)
    }


def test_computing_code_uses_of_infrastructure_only_its_reviewed_plumbing():
    """Infrastructure is no rule's input, so it must hold no computation: every name of it that a stage's own
    code uses is on moeflow.workflow.rule_code's PLUMBING list with a reason. A helper that computes (a DTensor's
    local part, activation checkpointing, TF32) lives in the concern that declares it."""
    plumbing = R.plumbing_names()
    unlisted = sorted(
        f"{rule}: {use}"
        for rule, script in rule_scripts().items()
        for use in infrastructure_calls(rule, script)
        if use.split(": ")[1] not in plumbing
    )
    assert not unlisted, (
        "code a stage computes with uses infrastructure that is not reviewed plumbing (an edit to it would rerun "
        "nothing): move it to the concern that uses it and declare it in moeflow.workflow.rule_code, or, if it "
        "cannot change any output, list it in PLUMBING with the reason:\n" + "\n".join(unlisted)
    )
    used = {use.split(": ")[1] for rule, script in rule_scripts().items() for use in infrastructure_calls(rule, script)}
    assert sorted(plumbing - used) == [], "PLUMBING lists a name no stage's code uses: drop it"


def test_the_boundary_check_names_a_computing_helper_in_infrastructure(tmp_path):
    """The check above, shown failing: a stage module that takes a DTensor's local part from runtime."""
    module = tmp_path / "gradients.py"
    module.write_text("from moeflow.runtime.compat import local_tensor\n\ndef f(g):\n    return local_tensor(g)\n")
    assert used_names(module) == {"moeflow.runtime.compat.local_tensor"}
    assert "moeflow.runtime.compat.local_tensor" not in R.plumbing_names()
    script = tmp_path / "warmup.py"
    script.write_text(
        "from moeflow.runtime import compat\nfrom moeflow.runtime.files import write_json as w\n"
        "compat.version_of('torch'); w('x', {})\n"
    )
    assert used_names(script) == {"moeflow.runtime.compat.version_of", "moeflow.runtime.files.write_json"}


def test_infrastructure_is_no_rules_input():
    for rule in R.RULES:
        assert not [m for m in R.declared_modules(rule) if R.is_infrastructure(m)], rule
    assert R.is_infrastructure("moeflow") and R.is_infrastructure("moeflow.runtime.stage")
    assert R.is_infrastructure("moeflow.settings") and R.is_infrastructure("moeflow.workflow.keys")
    assert not R.is_infrastructure("moeflow.train.settings") and not R.is_infrastructure("moeflow.paper")


def test_a_package_brings_its_modules_and_a_module_its_packages_init(monkeypatch, tmp_path):
    files = [f.relative_to(R.PACKAGE_DIR).as_posix() for f in R.module_files("paper")]
    assert files == sorted(p.relative_to(R.PACKAGE_DIR).as_posix() for p in (R.PACKAGE_DIR / "paper").glob("*.py"))
    assert [f.relative_to(R.PACKAGE_DIR).as_posix() for f in R.module_files("loading.factory")] == [
        "loading/__init__.py",
        "loading/factory.py",
    ]
    monkeypatch.chdir(REPO_ROOT)  # Snakemake's working directory: inputs relative to it
    assert R.code_files("paper") == [f"src/moeflow/{f}" for f in files]
    monkeypatch.chdir(tmp_path)
    assert R.code_files("paper") == [str(R.PACKAGE_DIR / f) for f in files]


def test_a_declaration_that_names_no_code_is_refused():
    with pytest.raises(ValueError, match="'model.factroy' is neither a package nor a module"):
        R.module_files("model.factroy")
    with pytest.raises(KeyError, match="no code is declared for rule 'trian_model'"):
        R.code_files("trian_model")


def test_the_rerun_table_covers_every_library_file_and_task_file():
    files = E.edited_files()
    assert any(f.startswith("workflow/tasks/") for f in files) and "src/moeflow/paper/tables.py" in files
    assert not [f for f in files if E.row_of(f) is None], "a file no row of tests/rerun_expectations.py covers"
    used = {E.row_of(f) for f in files}
    assert [row.code for row in E.ROWS if row not in used] == [], "a row that covers no file"
    assert all(set(row.reruns) <= set(E.RULE_ORDER) for row in E.ROWS)
    assert set(E.RULE_ORDER) | E.OUTSIDE_SMOKE == set(R.RULES) and not set(E.RULE_ORDER) & E.OUTSIDE_SMOKE


def test_docs_show_the_rerun_table():
    doc = E.DOCS.read_text()
    assert E.TABLE_START in doc and E.TABLE_END in doc
    assert E.with_table(doc) == doc, (
        "docs/reruns.md's code table is out of date: run python tests/rerun_expectations.py"
    )
