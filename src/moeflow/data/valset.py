"""The coverage validation set on disk, as a corpus folder in the data stages' format.

The folder's one split holds the selected held-out documents.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from moeflow.data.packing import pack_documents
from moeflow.data.shards import MANIFEST, open_split, read_documents, write_split
from moeflow.runtime.files import atomic_dir, read_json, write_json

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

    # packed as the pool was (the data stage's manifest records its data settings and padding)
    rows = pack_documents(documents(), first["seq_len"], first["pad_to_multiple_of"], first["pad_id"])
    with atomic_dir(out_dir) as tmp:
        shards = write_split(tmp / VALSET_SPLIT, rows, first["settings"]["data"]["shard_max_bytes"])
        manifest = {
            "kind": "coverage validation set",
            "split": VALSET_SPLIT,
            "seq_len": first["seq_len"],
            "pad_to_multiple_of": first["pad_to_multiple_of"],
            "pad_id": first["pad_id"],
            "shards": shards,
            **extra_manifest,
        }
        write_json(tmp / MANIFEST, manifest)
    return manifest


def open_valset(valset_dir: str | os.PathLike):
    """The validation set as a ``datasets.Dataset`` (rows in the data stage's format)."""
    return open_split(valset_dir, VALSET_SPLIT)
