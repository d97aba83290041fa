"""Editing any moeflow module reruns exactly the rules whose scripts import it (directly or through other
package modules) and the rules downstream of them: the rules' library inputs come from the imports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SMOKE, active_stack, scheduled_rules, snakemake

from moeflow.workflow.imports import PACKAGE_DIR, transitive_imports

pytestmark = pytest.mark.pipeline
MODULES = sorted(p.stem for p in PACKAGE_DIR.glob("*.py"))


def rule_scripts(workdir: Path) -> dict[str, Path]:
    """Each rule's stage script, read from the rule files (``script:`` rules and torchrun ``shell:`` rules)."""
    scripts = {}
    for smk in sorted((workdir / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]:
            name = block.split(":", 1)[0]
            found = re.search(r"scripts/(\w+\.py)", block)
            if found:
                scripts[name] = workdir / "workflow" / "scripts" / found.group(1)
    return scripts


def downstream(workdir: Path) -> dict[str, set[str]]:
    """Every rule of the smoke DAG (target paper) and the rules that depend on it, directly or not."""
    dot = snakemake(workdir, "paper", "--rulegraph", *SMOKE).stdout
    names = dict(re.findall(r'(\d+)\[label = "(\w+)"', dot))
    children: dict[str, set[str]] = {name: set() for name in names.values()}
    for a, b in re.findall(r"(\d+) -> (\d+)", dot):
        children[names[a]].add(names[b])
    closure = {}
    for rule in children:
        seen, todo = set(), [rule]
        while todo:
            for child in children[todo.pop()] - seen:
                seen.add(child)
                todo.append(child)
        closure[rule] = seen
    return closure


@pytest.mark.skipif(active_stack() != "pinned", reason="the rule graph and the imports are the same on both stacks")
def test_editing_any_module_reruns_exactly_its_importers_and_their_dependants(pipeline_copy):
    scripts, after = rule_scripts(pipeline_copy), downstream(pipeline_copy)
    assert set(scripts) >= set(after), "every rule of the DAG runs a stage script"
    importers = {
        m: {r for r, s in scripts.items() if r in after and f"moeflow.{m}" in transitive_imports(s)} for m in MODULES
    }
    importers["__init__"] = {r for r in after if r in scripts}
    assert importers["files"] and importers["train"] == {"pretrain_base", "warmup", "train_model"}
    for module in MODULES:
        path = pipeline_copy / "src" / "moeflow" / f"{module}.py"
        original = path.read_bytes()
        path.write_bytes(
            original + f"\n# an edit to {module}\n".encode()
        )  # a content change: Snakemake checksums small files
        try:
            expected = importers[module] | {d for r in importers[module] for d in after[r]}
            assert scheduled_rules(pipeline_copy, target="paper") == expected, module
        finally:
            path.write_bytes(original)
