"""The coverage stage: route the held-out pool, select the documents, write the set and its report.

The pool is routed with ``moeflow.evaluation.routing_stats``, the documents are selected with
``moeflow.coverage.cover`` and the set is written with ``moeflow.data.valset``; the report is ``coverage.json`` and
the heatmap."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeflow.coverage.cover import (
    CoverageInfeasible,
    build_constraints,
    coverage_report,
    infeasible_message,
    select_documents,
)
from moeflow.coverage.heatmap import coverage_heatmap
from moeflow.data.shards import iter_rows, open_split
from moeflow.data.valset import VALSET_SPLIT, write_valset
from moeflow.evaluation.routing_stats import route_pool
from moeflow.model.routing import UnsupportedModel, adapter_for
from moeflow.parallel.process_group import Ranks
from moeflow.runtime.files import write_json
from moeflow.runtime.stage import kill_point


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
    ranks: Ranks | None = None,
) -> dict[str, Any] | None:
    """The coverage stage: route the pools, select, check, write the valset, coverage.json and the heatmap.
    ``ranks`` (several ranks holding ``model`` in a layout): the ranks share the routing pass, and the main rank
    selects, writes and returns the report (None on the others)."""
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
    stats = route_pool(
        model, pools, int(settings["batch_tokens"]), attn_implementation, precision, adapter, ranks=ranks
    )
    if stats is None:  # not the main rank
        return None
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
