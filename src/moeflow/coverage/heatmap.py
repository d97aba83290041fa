"""The coverage stage's heatmap of documents per (layer, expert), the set beside a random subset.

The coverage stage's heatmap: documents meeting each (layer, expert) cell, the validation set beside a
random subset of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeflow.runtime.figures import pyplot
from moeflow.runtime.files import atomic_file


def coverage_heatmap(
    path: str | Path, layers: Sequence[int], valset_docs: Any, random_docs: Any, min_docs: int
) -> None:
    """The coverage stage's heatmap.png, layers x experts: documents meeting each cell, the validation set
    beside a random subset of the same size; cells below the threshold are marked. Deterministic bytes
    (no timestamps, no software tag). The counts are (L, E) integer arrays."""
    import numpy as np

    plt = pyplot()
    vmax = max(2 * min_docs, 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.35 * len(layers)), sharey=True, constrained_layout=True)
    for ax, counts, title in (
        (axes[0], valset_docs, "coverage validation set"),
        (axes[1], random_docs, "random subset, same tokens"),
    ):
        image = ax.imshow(
            np.minimum(counts, vmax), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest"
        )
        below_l, below_e = np.nonzero(counts < min_docs)
        ax.scatter(below_e, below_l, marker="x", color="red", s=12, linewidths=0.8)
        ax.set_title(f"{title}: {len(below_l)} cells below {min_docs} docs", fontsize=10)
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    axes[0].set_ylabel("MoE layer (decoder index)")
    fig.colorbar(image, ax=axes, label=f"documents (capped at {vmax})")
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
