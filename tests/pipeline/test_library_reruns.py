"""Editing library code reruns what the code means, never what merely imports it: every file of src/moeflow and
workflow/tasks, edited in a finished smoke pipeline, reruns exactly its row of tests/rerun_expectations.py (the
table of docs/reruns.md), target ``paper``.

Editing each file in turn would take one dry run per file (about 80). Instead every file is edited at once, and
Snakemake says which jobs each file reruns directly: a job's dry-run reason lists every updated input file
("Updated input files: ..."), but only for a job that no job upstream of it in the DAG reruns (Snakemake 9.27.1
marks the jobs below a rerun job "Input files updated by another job" without checking their own inputs). So
each dry run's DAG holds only a group of rules no two of which the rule graph connects (``--allowed-rules``,
with their jobs' outputs, from ``--summary``, as the targets): the other rules' outputs are plain files there,
no job is upstream of another, and each lists its own updated inputs. Five groups cover the smoke pipeline's
rules. What a file reruns is then the rules whose jobs list it and everything downstream of them in the rule
graph, which is what a dry run after editing that file alone schedules (checked for two files).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import rerun_expectations as E
from conftest import SMOKE, in_smoke, only_on, scheduled_rules, snakemake

pytestmark = [
    pytest.mark.pipeline,
    only_on("pinned", "the rule graph and the rules' inputs are the same on both stacks"),
]
UPDATED = "Updated input files: "


def rule_graph(workdir: Path) -> dict[str, set[str]]:
    """Each rule of the smoke DAG (target paper) and the rules that read its outputs."""
    dot = snakemake(workdir, "paper", "--rulegraph", "--nolock", *SMOKE).stdout
    names = dict(re.findall(r'(\d+)\[label = "(\w+)"', dot))
    children: dict[str, set[str]] = {name: set() for name in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)$", dot, flags=re.M):
        children[names[a]].add(names[b])
    return children


def downstream(children: dict[str, set[str]], rules: set[str]) -> set[str]:
    """``rules`` and every rule below them."""
    seen, todo = set(rules), list(rules)
    while todo:
        for child in children[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def unconnected_groups(children: dict[str, set[str]]) -> list[list[str]]:
    """The rules in groups with no rule-graph edge inside a group (greedy colouring, most connected first)."""
    neighbours = {rule: set(kids) for rule, kids in children.items()}
    for rule, kids in children.items():
        for kid in kids:
            neighbours[kid].add(rule)
    groups: list[list[str]] = []
    for rule in sorted(neighbours, key=lambda r: (-len(neighbours[r]), r)):
        group = next((g for g in groups if not neighbours[rule] & set(g)), None)
        if group is None:
            groups.append(group := [])
        group.append(rule)
    return groups


def rule_outputs(workdir: Path) -> dict[str, list[str]]:
    """Each rule's output files in the smoke DAG (target paper)."""
    out = snakemake(workdir, "paper", "--summary", "--nolock", *SMOKE).stdout
    outputs: dict[str, list[str]] = {}
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 6 and fields[0] != "output_file":
            outputs.setdefault(fields[2], []).append(fields[0])
    return outputs


def own_updated_inputs(workdir: Path, rules: list[str], outputs: dict[str, list[str]]) -> dict[str, set[str]]:
    """File -> the rules (of ``rules``, no two connected) with a job whose dry-run reason lists it as an updated
    input."""
    targets = [path for rule in rules for path in outputs[rule]]
    out = snakemake(
        workdir, *targets, "--dry-run", "--nolock", "--cores", "2", *SMOKE, "--allowed-rules", *rules
    ).stdout
    found: dict[str, set[str]] = {}
    for block in re.split(r"^(?:local)?rule ", out, flags=re.M)[1:]:
        rule = block.split(":", 1)[0]
        reason = re.search(r"^\s+reason: (.*)$", block, flags=re.M)
        assert rule in rules and reason, block
        for part in reason.group(1).split("; "):
            if part.startswith(UPDATED):
                for path in part.removeprefix(UPDATED).split(", "):
                    found.setdefault(path, set()).add(rule)
    return found


def edit(workdir: Path, path: str) -> bytes:
    """Append a comment (a content change: Snakemake checksums files under 1 MB); returns the old bytes."""
    file = workdir / path
    original = file.read_bytes()
    file.write_bytes(original + b"\n# an edit\n")
    return original


def test_editing_library_code_reruns_its_rows_rules(pipeline_copy):
    with ThreadPoolExecutor(2) as pool:  # independent Snakemake calls (--nolock)
        graph, outputs = pool.submit(rule_graph, pipeline_copy), pool.submit(rule_outputs, pipeline_copy)
        children, outputs = graph.result(), outputs.result()
        assert set(children) == set(outputs) == in_smoke(E.RULE_ORDER)
        files = E.edited_files(pipeline_copy)
        assert len(files) > 80
        for path in files:
            edit(pipeline_copy, path)
        direct: dict[str, set[str]] = {}
        groups = unconnected_groups(children)
        for found in pool.map(lambda rules: own_updated_inputs(pipeline_copy, rules, outputs), groups):
            for path, rules in found.items():
                direct.setdefault(path, set()).update(rules)
    assert set(direct) <= set(files), "a job reruns for a file this test did not edit"
    reruns = {path: downstream(children, direct.get(path, set())) for path in files}
    wrong = [
        f"{path}: {E.in_order(reruns[path])}, expected {E.in_order(in_smoke(E.row_of(path).reruns))}"
        for path in files
        if reruns[path] != in_smoke(E.row_of(path).reruns)
    ]
    assert not wrong, "a file reruns other rules than its row of tests/rerun_expectations.py:\n" + "\n".join(wrong)


def test_one_edit_reruns_what_its_row_says(pipeline_copy):
    # The group-by-group reading above, against Snakemake's own schedule for a single edit.
    # The helpers that moved out of infrastructure rerun training (a DTensor's local part: clipping, ESFT's
    # masking; activation checkpointing: which adapters get gradients); packing reruns tokenize and what follows.
    for path in (
        "src/moeflow/paper/tables.py",
        "src/moeflow/train/trainer.py",
        "src/moeflow/parallel/dtensors.py",
        "src/moeflow/model/activation_checkpointing.py",
        "src/moeflow/data/packing.py",
    ):
        original = edit(pipeline_copy, path)
        assert scheduled_rules(pipeline_copy, target="paper") == in_smoke(E.row_of(path).reruns), path
        (pipeline_copy / path).write_bytes(original)  # same content again: Snakemake's checksum reruns nothing
