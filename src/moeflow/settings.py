"""The configuration schema and typed settings from plain data (:func:`typed`, :func:`plain`).

The configuration schema (``config/schema.yaml``: the only place a default or an allowed value is
written) and typed settings from plain data: the frozen dataclasses each package declares next to its
user are built with :func:`typed`, and :func:`plain` turns them back into what a rule passes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"


DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"


SOURCE_SCHEMA = "#/$defs/source"  # a data source, in config/schema.yaml


MODEL_SCHEMA = "#/properties/model"


PRECISIONS = "#/properties/precision"


BAD_RECORD_POLICIES = "#/properties/data/properties/on_bad_record"


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


@functools.cache
def schema() -> dict[str, Any]:
    # libyaml's loader where PyYAML has it: the same safe constructor and resolver (the same data) at a tenth of
    # the pure-Python parser's cost, which every stage and every Snakefile parse paid (about 0.3-1 s).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(SCHEMA_PATH.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 (a safe loader)


def schema_node(pointer: str = "#") -> dict[str, Any]:
    """The schema at a JSON pointer such as ``#/$defs/training``, its ``$ref`` followed."""
    node: Any = schema()
    for part in pointer.lstrip("#").strip("/").split("/") if pointer.strip("#/") else []:
        node = node[part]
    return resolved(node)


def resolved(node: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with its ``$ref`` (within this schema) replaced by the target; keys beside the ``$ref``
    (a ``default``, a ``description``) win."""
    if "$ref" not in node:
        return dict(node)
    target = schema_node(node["$ref"])
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def matches(subschema: Mapping[str, Any], instance: Any) -> bool:
    return jsonschema.validators.validator_for(schema())(subschema).is_valid(instance)


def with_defaults(tree: Any, node: Mapping[str, Any] | str = "#") -> Any:
    """``tree`` with every key the schema gives a ``default`` and the tree leaves out filled in, at every
    depth (through ``$ref`` and per data source, by its kind: ``if``/``then``/``else``). Keys present
    (``null`` included) are kept. The schema is the only place a default is written."""
    node = schema_node(node) if isinstance(node, str) else resolved(node)
    if not isinstance(tree, Mapping):
        return copy.deepcopy(tree)
    out = dict(tree)
    branches = [node]
    if "if" in node:
        branches.append(node.get("then" if matches(node["if"], out) else "else") or {})
    for branch in branches:
        for key, sub in (branch.get("properties") or {}).items():
            sub = resolved(sub)
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
    properties = node.get("properties") or {}
    others = node.get("additionalProperties")
    for key, value in out.items():
        sub = properties.get(key, others if isinstance(others, Mapping) else None)
        if sub is not None and isinstance(value, Mapping):
            out[key] = with_defaults(value, sub)
    if properties and not isinstance(others, Mapping):
        # A record of named keys: in key order, so that the same settings are the same rule params (Snakemake
        # compares them in order) whether a key came from config.yaml, an overlay or the schema's default.
        # Maps of named entries (data.sources, runs) keep their order: it is meaningful.
        out = dict(sorted(out.items()))
    return out


def enum(pointer: str) -> tuple[Any, ...]:
    """The allowed values the schema lists at ``pointer`` (an enumeration is written only there)."""
    node = schema_node(pointer)
    return tuple(node["enum"] if "enum" in node else resolved(node["items"])["enum"])


def typed(cls: type, data: Mapping[str, Any]) -> Any:
    """The typed settings ``cls`` (a dataclass above) of plain data: nested sections typed too, lists made
    tuples where the field is a tuple. Keys ``data`` leaves out take the schema's default (a rule passes
    whole settings, so only tests and saved files leave any out); a key without one is an error."""
    hints = typing.get_type_hints(cls)
    schema_path = getattr(cls, "SCHEMA", None)
    data = with_defaults(data, schema_path) if schema_path else dict(data)
    names = [f.name for f in dataclasses.fields(cls)]
    missing, unknown = [n for n in names if n not in data], sorted(set(data) - set(names))
    if missing or unknown:
        raise ConfigError(
            f"{cls.__name__}: missing {missing or 'nothing'}, "
            f"unknown {unknown or 'nothing'} (known: {', '.join(names)})"
        )
    return cls(**{name: _typed(hints[name], data[name]) for name in names})


def _typed(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        hint = next(k for k in typing.get_args(hint) if k is not type(None))
    if dataclasses.is_dataclass(hint):
        return typed(hint, value)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    if hint is float and type(value) is int:  # YAML reads 32 as an int
        return float(value)
    return value


def plain(typed: Any) -> dict[str, Any]:
    """Typed settings as plain JSON-able data (the inverse of :func:`typed`)."""
    return json.loads(json.dumps(dataclasses.asdict(typed)))


def differing_keys(a: Any, b: Any, where: str = "") -> list[str]:
    """The dotted keys whose values differ between two config trees (a key on one side only counts; two differing
    roots that are not mappings: ``(the settings)``)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [
            d
            for k in sorted(set(a) | set(b), key=str)
            for d in differing_keys(a.get(k), b.get(k), f"{where}.{k}".strip("."))
        ]
    return [] if a == b else [where or "(the settings)"]
