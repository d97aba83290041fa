"""The coverage validation set on disk, and the stage that builds it: route the held-out pool
(``moeflow.pool_stats``), select (``moeflow.coverage``), then write the set in the data stage's format
(``moeflow.shards``), ``coverage.json`` and the heatmap."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifacts import coverage_heatmap
from .coverage import CoverageInfeasible, build_constraints, coverage_report, infeasible_message, select_documents
from .files import atomic_dir, read_json, write_json
from .packing import pack_documents
from .pool_stats import route_pool
from .routing import UnsupportedModel, adapter_for
from .shards import MANIFEST, iter_rows, open_split, read_documents, write_split
from .stage import kill_point

VALSET_SPLIT = "heldout"  # the validation set is a corpus folder whose one split holds held-out documents


def write_valset(
    pool_dirs: Sequence[str | os.PathLike],
    selected: Mapping[int, set[int]],
    out_dir: str | os.PathLike,
    extra_manifest: Mapping[str, Any],
) -> dict[str, Any]:
    """Write the selected held-out documents (``selected[corpus position] = doc_ids``) in the data stage's
    format: ``out_dir/manifest.json`` and ``out_dir/heldout/shard-*.arrow`` (open with ``open_valset``)."""
    first = read_json(Path(pool_dirs[0]) / MANIFEST)

    def documents() -> Iterator[tuple[int, list[int], None]]:
        for position, corpus_dir in enumerate(pool_dirs):
            wanted = selected.get(position, set())
            if wanted:
                for doc_id, ids in read_documents(open_split(corpus_dir, VALSET_SPLIT)):
                    if doc_id in wanted:
                        yield doc_id, ids, None

    rows = pack_documents(documents(), first["seq_len"], first.get("pad_to_multiple_of", 64), first.get("pad_id", 0))
    with atomic_dir(out_dir) as tmp:
        shards = write_split(
            tmp / VALSET_SPLIT, rows, first.get("settings", {}).get("data", {}).get("shard_max_bytes", 32 << 20)
        )
        manifest = {
            "kind": "coverage validation set",
            "split": VALSET_SPLIT,
            "seq_len": first["seq_len"],
            "pad_to_multiple_of": first.get("pad_to_multiple_of", 64),
            "pad_id": first.get("pad_id", 0),
            "shards": shards,
            **extra_manifest,
        }
        write_json(tmp / MANIFEST, manifest)
    return manifest


def open_valset(valset_dir: str | os.PathLike):
    """The validation set as a ``datasets.Dataset`` (rows in the data stage's format)."""
    return open_split(valset_dir, VALSET_SPLIT)


@dataclass
class StageOutputs:
    valset: str | os.PathLike
    json: str | os.PathLike
    heatmap: str | os.PathLike


def build_valset(
    model: Any,
    pool_dirs: Sequence[str | os.PathLike],
    settings: Mapping[str, Any],
    outputs: StageOutputs,
    attn_implementation: str,
    seed: int,
    precision: str = "fp32",
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The coverage stage: route the pools, select, check, write the valset, coverage.json and the heatmap."""
    corpora = list(settings["pool_corpora"])
    if len(corpora) != len(pool_dirs):
        raise ValueError(f"{len(pool_dirs)} pool folders for {len(corpora)} corpora in 'coverage.pool_corpora'")
    try:
        adapter = adapter_for(model)
    except UnsupportedModel as exc:
        raise UnsupportedModel(
            f"the coverage stage routes the held-out pool through the model's experts, and this model has none it can "
            f"read: {str(exc).rstrip('.')}. A dense run uses another run's validation set: "
            "set 'coverage.valset_of_run' to an MoE run"
        ) from None
    pools = [(name, iter_rows(open_split(path, VALSET_SPLIT))) for name, path in zip(corpora, pool_dirs)]
    stats = route_pool(model, pools, int(settings["batch_tokens"]), attn_implementation, precision, adapter)
    min_docs, min_tokens = int(settings["min_docs_per_expert"]), int(settings["min_tokens"])
    if stats.num_docs == 0:
        raise CoverageInfeasible(
            f"the held-out pool of {', '.join(corpora)} has no documents: raise 'data.split.heldout'"
        )
    constraints = build_constraints(stats, min_tokens, int(settings["pairs_per_layer"]))
    selection = select_documents(
        constraints, stats.doc_tokens, stats.doc_corpus, min_docs, int(settings["token_budget"]), seed
    )
    report, heat = coverage_report(stats, constraints, selection, settings, seed)
    if report["unmet"] and not settings["allow_unmet"]:
        message = infeasible_message(report["unmet"], min_docs, min_tokens)
        if stats.num_docs < min_docs:
            message = (
                f"the held-out pool of {', '.join(corpora)} has {stats.num_docs} document(s), fewer than "
                f"'coverage.min_docs_per_expert' ({min_docs}), so no expert can be covered. {message}"
            )
        raise CoverageInfeasible(message)
    kill_point("coverage.before_write")
    selected: dict[int, set[int]] = {}
    for j in selection.selected.tolist():
        selected.setdefault(int(stats.doc_corpus[j]), set()).add(int(stats.doc_id[j]))
    report["provenance"] = dict(provenance or {})
    write_valset(
        pool_dirs,
        selected,
        outputs.valset,
        {
            "corpora": corpora,
            "docs": report["valset"]["docs"],
            "tokens": report["valset"]["tokens"],
            "provenance": report["provenance"],
        },
    )
    kill_point("coverage.after_valset")  # one output written, two to go: what a rerun must not mistake for done
    coverage_heatmap(outputs.heatmap, stats.layers, heat["valset"], heat["random"], min_docs)
    write_json(outputs.json, report)
    return report
