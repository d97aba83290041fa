"""The paper's figures, saved as PNG and PDF with fixed metadata (stable bytes for the same inputs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moeflow.paper.inputs import RunRecord, TrainLog, comparison_rows, method_comparison_rows
from moeflow.runtime.figures import pyplot
from moeflow.runtime.files import atomic_file

FIGURE_FORMATS = ("png", "pdf")


def save_figure(fig, outdir: str | Path, name: str, provenance_line: str, dpi: int = 150) -> list[Path]:
    """Save ``fig`` as ``<name>.png`` and ``<name>.pdf`` with fixed metadata; close it; return the paths."""
    outdir = Path(outdir)
    metadata = {
        "png": {"Software": None, "Description": provenance_line},
        "pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None, "Subject": provenance_line},
    }
    paths = []
    for ext in FIGURE_FORMATS:
        path = outdir / f"{name}.{ext}"
        with atomic_file(path, "wb") as fh:
            fig.savefig(fh, format=ext, dpi=dpi, metadata=metadata[ext], bbox_inches="tight")
        paths.append(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def with_caption(fig, text: str):
    """``fig`` with ``text`` (its finding, moeflow.paper.findings) under it, wrapped to the figure's width."""
    import textwrap

    width = max(int(fig.get_figwidth() * 72 / 4.6), 40)  # characters of 8 pt text across the figure
    fig.canvas.draw()  # lays the figure out, so that the caption goes under everything it shows
    bottom = fig.get_tightbbox(fig.canvas.get_renderer()).y0  # inches
    fig.text(0.5, (bottom - 0.1) / fig.get_figheight(), textwrap.fill(text, width), ha="center", va="top", fontsize=8)
    return fig


def _colors(names: Sequence[str]) -> dict[str, Any]:
    plt = pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(sorted(names))}


def _plot_losses(ax, logs: Mapping[str, TrainLog]) -> None:
    colors = _colors(list(logs))
    for run, log in sorted(logs.items()):
        ax.plot(log.tokens, log.ce, color=colors[run], lw=1.2, label=f"{run}: training CE")
        if log.val_tokens:
            ax.plot(
                log.val_tokens,
                log.val_loss,
                color=colors[run],
                ls="--",
                marker="o",
                ms=4,
                label=f"{run}: validation loss",
            )
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def loss_figure(logs: Mapping[str, TrainLog]):
    """Training cross-entropy and validation loss (coverage validation set) against tokens, per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    _plot_losses(ax, logs)
    ax.set_title("Fine-tuning: training and validation loss")
    return fig


def lr_figure(logs: Mapping[str, TrainLog]):
    """The learning rate of every optimizer step (warmup, then cosine decay), per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    colors = _colors(list(logs))
    styles = ("-", "--", ":", "-.")
    for i, (run, log) in enumerate(sorted(logs.items())):  # styles differ: runs with one recipe overlap
        ax.plot(log.steps, log.lr, color=colors[run], ls=styles[i % len(styles)], lw=1.5 + 0.5 * (i == 0), label=run)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Learning-rate schedule")
    return fig


def expert_load_figure(run: str, log: TrainLog):
    """Per MoE layer: each expert's share of the layer's top-k assignments at every logged step."""
    import numpy as np

    plt = pyplot()
    loads = np.asarray(log.loads, dtype=np.float64)  # (steps, layers, experts)
    steps, layers, experts = loads.shape
    shares = loads / np.clip(loads.sum(-1, keepdims=True), 1, None)
    fig, axes = plt.subplots(layers, 1, figsize=(6.4, 1.0 + 1.3 * layers), sharex=True, squeeze=False)
    vmax = float(shares.max()) if shares.size else 1.0
    extent = (log.steps[0] - 0.5, log.steps[-1] + 0.5, experts - 0.5, -0.5)
    for layer in range(layers):
        ax = axes[layer, 0]
        image = ax.imshow(
            shares[:, layer, :].T,
            aspect="auto",
            cmap="viridis",
            vmin=0.0,
            vmax=vmax,
            extent=extent,
            interpolation="nearest",
        )
        ax.set_ylabel(f"layer {layer}\nexpert")
        if experts <= 16:
            ax.set_yticks(range(experts))
        ax.tick_params(axis="y", labelsize=6)
    axes[-1, 0].set_xlabel("optimizer step")
    bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.04, pad=0.02)
    bar.set_label(f"share of layer's assignments (uniform = {1 / experts:.3f})")
    fig.suptitle(f"Expert load during training, run '{run}'")
    return fig


def coverage_figure(coverage: Mapping[str, Any]):
    """The coverage validation set per (layer, expert), and how many cells and expert pairs it and random
    subsets of the same token count leave below the threshold (from the coverage stage's coverage.json)."""
    import numpy as np

    plt = pyplot()
    min_docs = int(coverage["settings"]["min_docs_per_expert"])
    layers = [layer["layer"] for layer in coverage["layers"]]
    docs = np.asarray([layer["docs"] for layer in coverage["layers"]], dtype=np.int64)
    fig, (heat, bars) = plt.subplots(
        1, 2, figsize=(11.0, 1.8 + 0.45 * len(layers)), gridspec_kw={"width_ratios": [3, 2]}
    )
    image = heat.imshow(docs, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    below_l, below_e = np.nonzero(docs < min_docs)
    heat.scatter(below_e, below_l, marker="x", color="red", s=20, label=f"below {min_docs} documents")
    heat.set_xlabel("expert")
    heat.set_ylabel("MoE layer")
    heat.set_xticks(range(docs.shape[1]))
    heat.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    heat.set_title(
        "Validation set: documents per (layer, expert)\n"
        f"({coverage['valset']['docs']} documents, {coverage['valset']['tokens']:,} tokens)",
        fontsize=10,
    )
    fig.colorbar(image, ax=heat, label="documents routing >= min_tokens tokens there")
    if docs.size <= 256:  # small enough to print each count
        for (layer, expert), n in np.ndenumerate(docs):
            heat.text(
                expert,
                layer,
                str(n),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if n < docs.max() / 2 else "black",
            )
    if len(below_l):
        heat.legend(fontsize=8, loc="upper right")
    random = coverage["random_comparison"]
    kinds = ["cells", "pairs"]
    x = np.arange(len(kinds))
    ours = [coverage["valset"]["cells_below"], coverage["valset"]["pairs_below"]]
    means = [random[f"{k}_below"]["mean"] for k in kinds]
    spread = np.array(
        [[m - random[f"{k}_below"]["min"], random[f"{k}_below"]["max"] - m] for k, m in zip(kinds, means)]
    ).T
    b1 = bars.bar(x - 0.2, ours, width=0.4, label="coverage validation set")
    b2 = bars.bar(
        x + 0.2, means, width=0.4, yerr=spread, capsize=4, label=f"random subsets (mean, min-max of {random['draws']})"
    )
    bars.bar_label(b1, fontsize=8)
    bars.bar_label(b2, labels=[f"{m:.1f}" for m in means], fontsize=8, padding=2)
    bars.set_ylim(0, max(ours + [m + e for m, e in zip(means, spread[1])] + [1]) * 1.25)
    bars.set_xticks(x, ["(layer, expert) cells", "top expert pairs"])
    bars.set_ylabel(f"constraints below {min_docs} documents (count)")
    bars.set_title("Left below the threshold, same token count", fontsize=10)
    bars.legend(fontsize=8)
    fig.tight_layout()
    return fig


def comparison_figure(records: Sequence[RunRecord]):
    """MoE vs dense: loss against tokens, training throughput and peak memory side by side."""
    plt = pyplot()
    rows = comparison_rows(records)
    fig, axes = plt.subplots(1, 3, figsize=(12.0, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    _plot_losses(axes[0], {r.name: r.log for r in records})
    axes[0].set_title("Loss against tokens")
    colors = _colors([r["run"] for r in rows])
    names = [r["run"] for r in rows]
    for ax, key, label in (
        (axes[1], "train tokens/s", "training throughput (tokens/s)"),
        (axes[2], "train peak MiB", "peak memory in training (MiB)"),
    ):
        values = [r[key] or 0.0 for r in rows]
        bars = ax.bar(names, values, color=[colors[n] for n in names])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_ylabel(label)
        ax.set_xlabel("run")
        ax.set_ylim(0, max(values + [1.0]) * 1.15)
        ax.set_title(label.split(" (")[0].capitalize())
    fig.suptitle("MoE vs dense (same data, token budget and recipe)")
    fig.tight_layout()
    return fig


def drift_figure(records: Sequence[RunRecord]):
    """Per MoE run, a heat map layers x experts of the change in each expert's load share from the base to
    the fine-tuned router; experts that gained (+) or lost (-) more than half their load are marked."""
    import numpy as np

    plt = pyplot()
    drifts = [(r.name, r.results.drift) for r in records if r.results.drift is not None]
    fig, axes = plt.subplots(
        1, max(len(drifts), 1), figsize=(4.8 * max(len(drifts), 1) + 1.2, 3.0), squeeze=False, constrained_layout=True
    )
    if not drifts:
        axes[0, 0].text(0.5, 0.5, "no MoE run: no routing drift", ha="center", va="center")
        axes[0, 0].set_axis_off()
        return fig
    load = lambda d, model: np.asarray([layer[f"load_{model}"] for layer in d["layers"]])  # noqa: E731
    changes = {run: 100 * (load(d, "finetuned") - load(d, "base")) for run, d in drifts}
    vmax = max(max(float(np.abs(c).max()) for c in changes.values()), 1e-9)
    for ax, (run, d) in zip(axes[0], drifts):
        image = ax.imshow(changes[run], aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        for row, layer in enumerate(d["layers"]):
            for expert, mark in [(e, "+") for e in layer["gained"]] + [(e, "\u2212") for e in layer["lost"]]:
                ax.text(expert, row, mark, ha="center", va="center", fontsize=10, fontweight="bold")
        labels = [
            f"layer {layer['layer']}\nJS {layer['js_divergence']:.3f}, "
            f"{layer['changed_expert_set_fraction']:.0%} sets changed"
            for layer in d["layers"]
        ]
        ax.set_yticks(range(len(d["layers"])), labels, fontsize=7)
        ax.set_xticks(range(changes[run].shape[1]))
        ax.set_xlabel("expert")
        ax.set_title(f"run '{run}' ({d['tokens']:,} tokens)", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="load share change (percentage points)")
    fig.suptitle("Routing drift: base to fine-tuned router")
    return fig


METHOD_BARS = (
    ("trainable params", "trainable parameters"),
    ("optimizer state MiB", "optimizer state (MiB)"),
    ("step s", "median step (s)"),
    ("routing JS divergence", "routing drift (JS, bits)"),
)


def methods_figure(records: Sequence[RunRecord]):
    """The methods comparison (inputs.method_comparison_rows): target-slice gain against general-slice forgetting,
    one point per MoE run, beside its trainable parameters, optimizer state, step time and routing drift."""
    plt = pyplot()
    rows = method_comparison_rows(records)
    fig, axes = plt.subplots(
        1, 1 + len(METHOD_BARS), figsize=(15.0, 3.6), gridspec_kw={"width_ratios": [2] + [1] * len(METHOD_BARS)}
    )
    scatter = axes[0]
    if not rows:
        for ax in axes:
            ax.set_axis_off()
        scatter.text(0.5, 0.5, "no MoE run: no methods to compare", ha="center", va="center")
        return fig
    names = [r["run"] for r in rows]
    colors = _colors(names)
    for r in rows:
        if r["general forgetting"] is not None and r["target gain"] is not None:
            scatter.scatter(r["general forgetting"], r["target gain"], color=colors[r["run"]], s=40, zorder=3)
            scatter.annotate(
                f"{r['run']} ({r['method']})",
                (r["general forgetting"], r["target gain"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
    scatter.axvline(0.0, color="grey", lw=0.8)
    scatter.axhline(0.0, color="grey", lw=0.8)
    scatter.set_xlabel("general-slice forgetting (loss after - before)")
    scatter.set_ylabel("target-slice gain (loss before - after)")
    scatter.grid(alpha=0.3)
    methods = {r["method"] for r in rows}
    scatter.set_title("Gain against forgetting" + ("" if len(methods) > 1 else " (one method only)"), fontsize=10)
    labels = [f"{r['run']}\n({r['method']})" for r in rows]
    for ax, (key, label) in zip(axes[1:], METHOD_BARS):
        values = [r[key] or 0.0 for r in rows]
        bars = ax.bar(labels, values, color=[colors[n] for n in names])
        ax.bar_label(bars, labels=[f"{v:,.3g}" for v in values], fontsize=7)
        ax.set_ylim(0, max(values + [1e-12]) * 1.2)
        ax.set_title(label, fontsize=9, pad=12)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Training methods on the same base model and data")
    fig.tight_layout()
    return fig
