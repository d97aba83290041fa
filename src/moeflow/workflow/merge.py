"""Merge the configuration's layers: the default, the overlays, a run's overlay; ``precision: auto`` resolved."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from moeflow.settings import ConfigError, with_defaults


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``base`` with ``overlay`` merged in, as every overlay applies (a config file, ``overrides``, a run):
    mappings merge key by key; ``null`` removes the key (``runs: {dense: null}`` drops the run); a data
    source whose ``type`` changes is replaced whole; any other value, lists included, replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        below = out.get(key)
        if value is None:
            out.pop(key, None)
        elif (
            isinstance(value, Mapping)
            and isinstance(below, Mapping)
            and not _replaces_source(path + (key,), below, value)
        ):
            out[key] = deep_merge(below, value, path + (key,))
        else:
            out[key] = deep_merge({}, value, path + (key,)) if isinstance(value, Mapping) else copy.deepcopy(value)
    return out


def _replaces_source(path: tuple[str, ...], below: Mapping[str, Any], value: Mapping[str, Any]) -> bool:
    """A data source of another ``type``: the keys of the old kind must not survive (``packages`` of a
    stdlib source under a jsonl one)."""
    return path[:2] == ("data", "sources") and len(path) == 3 and "type" in value and value["type"] != below.get("type")


# config/config.yaml's overlay for a model built from config (model.pretrained null), such as the embedded
# default's dense comparison run: a pretrained folder gets only the runs its own config names.
MODEL_FROM_CONFIG = "model_from_config"


def merged(default: Mapping[str, Any], overlays: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The default config with the overlays merged over it, the schema's defaults filled in. The
    ``model_from_config`` overlay (the default's, with what the overlays add to it) goes right over the
    default, under the overlays, when the result builds its model from config; it is dropped otherwise."""
    layers = [default, *overlays]
    from_config = functools.reduce(deep_merge, [layer.get(MODEL_FROM_CONFIG) or {} for layer in layers], {})
    base, *overlays = [{k: v for k, v in layer.items() if k != MODEL_FROM_CONFIG} for layer in layers]
    cfg = functools.reduce(deep_merge, overlays, base)
    if not (with_defaults(cfg).get("model") or {}).get("pretrained"):
        cfg = functools.reduce(deep_merge, overlays, deep_merge(base, from_config))
    return with_precision(with_defaults(cfg))


# ``precision: auto`` by ``hardware.device``: fp32 on the CPU (bf16 autocast measured 0.66x/0.86x fp32's speed
# on this 2-core machine: config/config.yaml), bf16 on CUDA (tensor cores: ~989 vs ~67 TFLOP/s on an H100).
AUTO_PRECISION = {"cpu": "fp32", "cuda": "bf16"}


def resolved_precision(cfg: Mapping[str, Any]) -> str:
    """The precision a config computes in: ``precision``, with ``auto`` made fp32 or bf16 by ``hardware.device``."""
    precision = cfg["precision"]
    return AUTO_PRECISION[cfg["hardware"]["device"]] if precision == "auto" else precision


def with_precision(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``precision: auto`` resolved, once, where the merged config (or a run's) is made: every
    stage key, rule and stage then sees fp32 or bf16. (A run that changes ``hardware.device`` over a base
    whose ``auto`` was already resolved sets its own ``precision``.)"""
    return {**cfg, "precision": resolved_precision(cfg)}


def run_names(cfg: Mapping[str, Any]) -> list[str]:
    return list(cfg["runs"])


def merged_run(cfg: Mapping[str, Any], run: str) -> dict[str, Any]:
    """The base config with the run's overlay merged in (and the ``runs`` table removed), not yet checked."""
    runs = cfg["runs"]
    if run not in runs:
        raise ConfigError(f"unknown run {run!r}; the config defines: {', '.join(runs) or 'no runs'}")
    base = {k: v for k, v in cfg.items() if k != "runs"}
    return with_precision(with_defaults(deep_merge(base, runs[run] or {})))
