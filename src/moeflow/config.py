"""Load, merge, validate and hash the configuration; list the runs.

The configuration is one YAML tree (``config/config.yaml`` plus any overlays). A *run* is a named
overlay of that tree (``runs: {dense: {model: ...}}``); every run's merged config is validated on its
own. Stage outputs are keyed by a hash of exactly the settings that stage depends on, so two runs that
agree on, say, the data settings share the data stages.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"
STACKS = ("pinned", "current")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


# --------------------------------------------------------------------------- loading and merging


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively by ``overlay`` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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
    """Read the default config, merge the given overlay files and overrides, and validate the result."""
    cfg = read_yaml(DEFAULT_CONFIG)
    for path in paths:
        cfg = deep_merge(cfg, read_yaml(path))
    if overrides:
        cfg = deep_merge(cfg, overrides)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- validation


def _schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def _key_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _describe(error: Any) -> str:
    where = _key_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        return (
            f"config key '{where}': unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed keys are: {', '.join(allowed)}"
        )
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in error.validator_value)
        return f"config key '{where}': {error.instance!r} is not one of the allowed values ({allowed})"
    return f"config key '{where}': {error.message}"


def validate(cfg: Mapping[str, Any]) -> None:
    """Validate the base config and every run's merged config; raise ConfigError naming each bad key."""
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(_schema())
    validator = validator_cls(_schema())

    def check(tree: Mapping[str, Any], label: str) -> None:
        errors = sorted(validator.iter_errors(tree), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            lines = "\n".join(f"  - {_describe(e)}" for e in errors)
            raise ConfigError(f"invalid configuration{label}:\n{lines}\n(schema: {SCHEMA_PATH.relative_to(REPO_ROOT)})")
        for problem in semantic_problems(tree):
            raise ConfigError(f"invalid configuration{label}: {problem}")

    check(cfg, "")
    for name in cfg.get("runs", {}):
        if not RUN_NAME.match(name):
            raise ConfigError(f"config key 'runs.{name}': run names may use letters, digits, '_', '.', '-' only")
        check({**run_config(cfg, name, validated=False), "runs": {}}, f" (run '{name}')")


def semantic_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Checks a schema cannot express. Each message names the key(s) and what to do."""
    problems: list[str] = []
    data = cfg.get("data", {})
    split = data.get("split", {})
    if split and split.get("heldout", 0) + split.get("test", 0) >= 1:
        problems.append("config keys 'data.split.heldout' + 'data.split.test' must sum to less than 1")
    named = data.get("eval_corpora", []) + cfg.get("coverage", {}).get("pool_corpora", [])
    for corpus in named + [data.get("base_corpus"), data.get("finetune_corpus")]:
        if corpus is not None and corpus not in data.get("sources", {}):
            problems.append(
                f"config key 'data': corpus {corpus!r} is not among 'data.sources' "
                f"({', '.join(sorted(data.get('sources', {})))})"
            )
    return problems


# --------------------------------------------------------------------------- runs and stacks


def run_names(cfg: Mapping[str, Any]) -> list[str]:
    return list(cfg.get("runs", {}) or {})


def run_config(cfg: Mapping[str, Any], run: str, validated: bool = True) -> dict[str, Any]:
    """The base config with the run's overlay merged in (and the ``runs`` table removed)."""
    runs = cfg.get("runs", {}) or {}
    if run not in runs:
        raise ConfigError(f"unknown run {run!r}; the config defines: {', '.join(runs) or 'no runs'}")
    base = {k: v for k, v in cfg.items() if k != "runs"}
    merged = deep_merge(base, runs[run] or {})
    if validated:
        validate({**merged, "runs": {}})
    return merged


def resolve_stack(cfg: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """``stack`` from the config, else $STACK, else 'pinned'."""
    stack = cfg.get("stack") or environ.get("STACK") or "pinned"
    if stack not in STACKS:
        raise ConfigError(f"stack {stack!r} (from config key 'stack' or $STACK) must be one of {', '.join(STACKS)}")
    return stack


# --------------------------------------------------------------------------- hashing and stage keys


def stable_hash(obj: Any, length: int = 12) -> str:
    """A hash of a JSON-able object that is the same in every process (unlike ``hash()``)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def tokenizer_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the tokenizer depends on: its own settings, the sources and split it is trained on."""
    data = cfg["data"]
    return {
        "tokenizer": cfg["tokenizer"],
        "pretrained_model": cfg["model"].get("pretrained"),
        "sources": data["sources"],
        "split": data["split"],
        "on_bad_record": data["on_bad_record"],
    }


def data_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the tokenized shards depend on."""
    return {"tokenizer": tokenizer_settings(cfg), "data": cfg["data"]}


def tokenizer_key(cfg: Mapping[str, Any]) -> str:
    return "t-" + stable_hash(tokenizer_settings(cfg))


def data_key(cfg: Mapping[str, Any]) -> str:
    return "d-" + stable_hash(data_settings(cfg))


def base_model_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the base model depends on: a user's pretrained folder, or the embedded default's pretraining."""
    model = cfg["model"]
    if model.get("pretrained"):
        return {"pretrained": model["pretrained"]}
    return {
        "model": model,
        "pretrain": cfg.get("pretrain", {}),
        "data": data_key(cfg),
        "precision": cfg["precision"],
        "seed": cfg["seed"],
    }


def base_key(cfg: Mapping[str, Any]) -> str:
    return "b-" + stable_hash(base_model_settings(cfg))


def coverage_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"base": base_key(cfg), "data": data_key(cfg), "coverage": cfg["coverage"], "seed": cfg["seed"], "model": cfg["model"]}


def coverage_key(cfg: Mapping[str, Any]) -> str:
    return "c-" + stable_hash(coverage_settings(cfg))


def plan_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the memory planner depends on: the model, the hardware and the training shape."""
    return {
        "model": cfg["model"],
        "vocab_size": cfg["tokenizer"].get("vocab_size"),
        "hardware": cfg["hardware"],
        "train": cfg["train"],
        "seq_len": cfg["data"]["seq_len"],
        "precision": cfg["precision"],
    }
