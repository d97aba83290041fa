"""matplotlib with settings that keep figure bytes stable (Agg backend, fixed hash salt, no dates)."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the Agg backend with settings that keep figure bytes stable."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "moeflow", "pdf.compression": 6, "path.simplify": True, "figure.dpi": 100})
    return plt
