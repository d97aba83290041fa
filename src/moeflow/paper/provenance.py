"""Provenance of the paper's artifacts: code versions, config hash, fingerprints, SHA-256s.

The code versions are those each upstream stage recorded; the fingerprints are the environment report's and the
data manifests'; every artifact has its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moeflow.runtime.files import write_json


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def config_hash(config: Mapping[str, Any]) -> str:
    from moeflow.runtime.files import stable_hash

    return stable_hash(config, length=16)


def stage_provenance(docs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``provenance`` record of each upstream output (label -> record), for outputs that have one."""
    return {
        label: doc["provenance"]
        for label, doc in sorted(docs.items())
        if isinstance(doc, Mapping) and "provenance" in doc
    }


def manifest_fingerprint(manifest_path: str | Path) -> str:
    """A data manifest's fingerprint: the hash of its bytes (it records sources, tokenizer and counts)."""
    return sha256_file(manifest_path)[:16]


def provenance_record(
    config: Mapping[str, Any],
    stages: Mapping[str, Mapping[str, Any]],
    env_report: str | Path,
    manifests: Mapping[str, str | Path],
) -> dict[str, Any]:
    """What every artifact carries: config hash, each upstream stage's code version and provenance,
    the environment report's hash, and the data manifests' fingerprints."""
    return {
        "config_hash": config_hash(config),
        "stages": {label: dict(p) for label, p in sorted(stages.items())},
        "code_versions": sorted({p["moeflow_code"] for p in stages.values() if "moeflow_code" in p}),
        "environment_report": sha256_file(env_report)[:16],
        "data_manifests": {label: manifest_fingerprint(p) for label, p in sorted(manifests.items())},
    }


def provenance_line(record: Mapping[str, Any]) -> str:
    """One line that identifies a provenance record (embedded in every artifact)."""
    data = ",".join(f"{k}={v}" for k, v in record["data_manifests"].items())
    record_id = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return (
        f"moeflow provenance {record_id}: config {record['config_hash']}; code {'+'.join(record['code_versions'])}; "
        f"env {record['environment_report']}; data {data} (full record: provenance.json)"
    )


def write_provenance(
    path: str | Path, record: Mapping[str, Any], artifacts: Iterable[str | Path], root: str | Path
) -> None:
    """``provenance.json``: the record plus the SHA-256 of every artifact, by path relative to ``root``."""
    files = {Path(p).relative_to(root).as_posix(): sha256_file(p) for p in sorted(map(str, artifacts))}
    write_json(path, {**record, "artifacts": files})
