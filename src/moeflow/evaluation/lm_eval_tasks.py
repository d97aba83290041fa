"""The tasks ``evaluate.tasks`` names, resolved: moeflow's task YAMLs, a YAML file, lm-eval's registry.

moeflow's own task YAMLs are those of workflow/tasks/; a task of lm-eval's registry is resolved through its
TaskManager, whose data must be on the machine.

The config check (``moeflow.workflow.checks``) calls :func:`task_problems` when the Snakefile loads: an unknown
name or a YAML that does not parse fails there, naming ``evaluate.tasks[i]``. Nothing here imports lm-eval except
to look up a name that is not one of moeflow's tasks (its registry takes seconds to index).
"""

from __future__ import annotations

import functools
import glob
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).resolve().parents[3] / "workflow" / "tasks"


DOCS_KEY = "moeflow_docs"  # in a task YAML's metadata: the kind of documents moeflow builds for it


YAML_SUFFIXES = (".yaml", ".yml")


LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class TaskSpecError(ValueError):
    """A task entry that cannot be resolved, with the key's path and what to do."""


@dataclass(frozen=True)
class TaskSpec:
    """One ``evaluate.tasks`` entry: ``spec`` as written, ``label`` (the result file's name), the YAML that
    defines it (None for a registry task), and for moeflow's corpus tasks the kind of documents it needs."""

    spec: str
    label: str
    yaml_path: Path | None
    docs: str | None

    @property
    def registry(self) -> bool:
        return self.yaml_path is None

    @property
    def include_path(self) -> list[str]:
        """lm-eval's include path for the task: moeflow's tasks, and the folder of a task YAML."""
        return [str(TASKS_DIR)] + ([str(self.yaml_path.parent)] if self.yaml_path else [])

    @property
    def files(self) -> list[Path]:
        """The YAML and the Python modules beside it (its ``!function`` code): editing one reruns the task."""
        return [self.yaml_path, *sorted(self.yaml_path.parent.glob("*.py"))] if self.yaml_path else []


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML with lm-eval's tags (``!function module.name``) kept as strings: enough to read a task's name."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {loader.construct_scalar(node)}")


def read_task_yaml(path: Path, where: str) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # noqa: S506 (a SafeLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise TaskSpecError(f"config key '{where}': {path} is not a readable task YAML ({exc}); fix the file") from None
    if not isinstance(data, dict) or not isinstance(data.get("task") or data.get("group"), str):
        raise TaskSpecError(f"config key '{where}': {path} defines no task (no 'task:' or 'group:' name); fix the file")
    return data


def _docs_kind(data: Mapping[str, Any]) -> str | None:
    metadata = data.get("metadata")
    return metadata.get(DOCS_KEY) if isinstance(metadata, dict) else None


@functools.cache
def local_tasks() -> dict[str, Path]:
    """moeflow's own tasks by name: the YAMLs of workflow/tasks/."""
    out = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        data = read_task_yaml(path, "evaluate.tasks")
        out[data.get("task") or data["group"]] = path
    return out


@functools.cache
def registry_has(name: str) -> bool:
    """Whether lm-eval's task registry knows ``name`` (a task, group or tag)."""
    from lm_eval.tasks import TaskManager

    return name in TaskManager().all_tasks


def resolve(spec: str, where: str) -> TaskSpec:
    """The task an ``evaluate.tasks`` entry names (``where``: the key's path, for the message)."""
    if not isinstance(spec, str) or not spec:
        raise TaskSpecError(f"config key '{where}': {spec!r} must be a task name or a path to a task YAML")
    if spec.endswith(YAML_SUFFIXES):
        path = Path(spec)
        if not path.is_file():
            raise TaskSpecError(f"config key '{where}': the task YAML {spec} does not exist; fix the path")
        data = read_task_yaml(path, where)
        return TaskSpec(spec, _label(path.stem, where), path, _docs_kind(data))
    if spec in local_tasks():
        path = local_tasks()[spec]
        return TaskSpec(spec, _label(spec, where), path, _docs_kind(read_task_yaml(path, where)))
    try:
        known = registry_has(spec)
    except ImportError:
        raise TaskSpecError(
            f"config key '{where}': {spec!r} is not one of moeflow's tasks ({', '.join(local_tasks())}) and lm-eval, "
            "whose registry would know it, does not import on this stack"
        ) from None
    if not known:
        raise TaskSpecError(
            f"config key '{where}': {spec!r} is neither one of moeflow's tasks ({', '.join(local_tasks())}, in "
            f"{TASKS_DIR}) nor a task in lm-eval's registry; check the name (`lm-eval ls tasks` lists them) or "
            "give the path of a task YAML"
        )
    return TaskSpec(spec, _label(spec, where), None, None)


def _label(name: str, where: str) -> str:
    if not LABEL.match(name):
        raise TaskSpecError(
            f"config key '{where}': {name!r} cannot name a result file (letters, digits, '_', '.', '-' only); "
            "rename the task or its YAML file"
        )
    return name


def resolve_all(tasks: Sequence[str], key: str = "evaluate.tasks") -> list[TaskSpec]:
    """Every entry resolved; two entries with the same result file are refused."""
    out = [resolve(spec, f"{key}[{i}]") for i, spec in enumerate(tasks)]
    seen: dict[str, int] = {}
    for i, task in enumerate(out):
        if task.label in seen:
            raise TaskSpecError(
                f"config key '{key}[{i}]': {task.spec!r} writes the same result file ({task.label}.json) as "
                f"'{key}[{seen[task.label]}]'; name each task once"
            )
        seen[task.label] = i
    return out


def task_problems(tasks: Sequence[str], eval_corpora: Sequence[str]) -> list[str]:
    """The config check's messages for ``evaluate.tasks``: every entry resolves, and moeflow's corpus tasks have
    corpora to run on."""
    try:
        resolved = resolve_all(tasks)
    except TaskSpecError as exc:
        return [str(exc)]
    return [
        f"config key 'evaluate.tasks[{i}]': {task.spec!r} runs on the test split of each of data.eval_corpora, "
        "which is empty; name a corpus there or drop the task"
        for i, task in enumerate(resolved)
        if task.docs and not eval_corpora
    ]


def by_label(tasks: Sequence[str]) -> dict[str, TaskSpec]:
    """A run's ``evaluate.tasks`` by result file label (rule lm_eval_task's ``{task}`` wildcard)."""
    return {task.label: task for task in resolve_all(tasks)}


def missing_data_files(task: TaskSpec, where: str) -> list[str]:
    """Messages for the local data files a task YAML names (``dataset_kwargs.data_files``) that do not exist."""
    if task.yaml_path is None:
        return []
    kwargs = read_task_yaml(task.yaml_path, where).get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    named = files.values() if isinstance(files, dict) else [files]
    paths = [p for entry in named for p in ([entry] if isinstance(entry, str) else entry or [])]
    return [
        f"config key '{where}': the task YAML {task.yaml_path} reads the data file {p}, which does not exist "
        "(relative to the working directory); put the file there or fix dataset_kwargs.data_files"
        for p in paths
        if not glob.glob(p)  # a literal path or a pattern
    ]
