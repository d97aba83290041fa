"""Load the configuration: the default, the overlays, the schema's defaults once, the checks.

Load the configuration: ``config/config.yaml`` plus any overlays, merged (``moeflow.workflow.merge``),
the schema's defaults filled in once, and checked (``moeflow.workflow.checks``); each run's config; the stack.

A *run* is a named overlay of that tree (``runs: {dense: {model: ...}}``); every run's merged config is
checked on its own. What each stage then takes of a run's config is ``moeflow.workflow.keys``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from moeflow.settings import DEFAULT_CONFIG, ConfigError, enum
from moeflow.workflow.checks import check, validate
from moeflow.workflow.merge import merged, merged_run


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def load(*paths: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read the default config, merge the given overlay files and overrides (in order), fill in the
    schema's defaults and validate the result (see :func:`merged`)."""
    cfg = merged(read_yaml(DEFAULT_CONFIG), [read_yaml(path) for path in paths] + ([overrides] if overrides else []))
    validate(cfg)
    return cfg


def run_config(cfg: Mapping[str, Any], run: str) -> dict[str, Any]:
    """The base config with the run's overlay merged in (and the ``runs`` table removed), checked."""
    run_cfg = merged_run(cfg, run)
    check({**run_cfg, "runs": {}}, f" (run '{run}')")
    return run_cfg


STACKS = tuple(s for s in enum("#/properties/stack") if s)  # null: $STACK


def resolve_stack(cfg: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """``stack`` from the config, else $STACK, else 'pinned'."""
    stack = cfg.get("stack") or environ.get("STACK") or "pinned"
    if stack not in STACKS:
        raise ConfigError(f"stack {stack!r} (from config key 'stack' or $STACK) must be one of {', '.join(STACKS)}")
    return stack
