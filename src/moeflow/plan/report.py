"""The memory plan as text: a failed plan's summary, the Markdown report, the refusal.

A failed plan raises with the summary; the refusal is the check that refuses a job that does not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import yaml

from moeflow.plan.fit import HEADROOM, MEM_MB_SOURCE
from moeflow.plan.memory import GIB
from moeflow.plan.shapes import PlanError

log = logging.getLogger("moeflow.plan")


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _size(n: float) -> str:
    if n == 0:
        return "0"
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"


def summary(p: Mapping[str, Any]) -> str:
    """The plan in a few lines: parameters, memory per device by component, the verdict and the options."""
    job, mem, gib, params = p["job"], p["per_device_bytes"], p["per_device_gib"], p["parameters"]
    memory = p["device_memory_bytes"] / GIB
    usable = p["usable_fraction"] * memory
    sharing = f" (states over {job['shard_ranks']} ranks)" if job["shard_ranks"] > 1 else ""
    worst = p["worst_phase"]
    mtp = params["by_category"].get("mtp", 0)
    carried = f" and {_count(mtp)} in MTP layers (carried frozen)" if mtp else ""
    lines = [
        f"{job['method']} fine-tune of {p['model_type']} with {_count(params['without_mtp'])} parameters "
        f"({_count(params['active_per_token'])} active per token){carried}, {job['precision']}, micro-batch "
        f"{job['micro_batch_size']} x {job['seq_len']} tokens, gradient checkpointing "
        f"{'on' if job['gradient_checkpointing'] else 'off'}, on {job['num_devices']} x {job['device']} of "
        f"{memory:.1f} GiB ({p['device_memory_source']}), parallel.strategy {job['strategy']}"
        f"{sharing}:",
        *(
            [
                f"  LoRA rank {p['lora']['rank']} on {', '.join(p['lora']['targets'])}, router {p['lora']['router']}: "
                f"{_count(p['lora']['trainable'])} trainable parameters ({_count(p['lora']['adapter'])} in adapters); "
                f"the {_count(params['total'])} base weights are frozen"
            ]
            if "lora" in p
            else []
        ),
        step_summary(mem, p["phases"]["step"]["host_bytes"]),
        phases_summary(p["phases"]),
        f"  worst phase {worst}: "
        + ("the step's terms above" if worst == "step" else _terms(p["phases"][worst]["device_bytes"])),
        f"  verdict of the {p['worst_phase']} phase: {p['verdict'].replace('_', ' ')} (usable {usable:.1f} of "
        f"{memory:.1f} GiB, {round(100 * (1 - p['usable_fraction']))}% headroom)",
        host_summary(p["host"], p["phases"]),
    ]
    states = sum(gib.get(term, 0) for term in ("weights", "gradients", "optimizer"))  # none under CPU offload
    if p["verdict"] != "fits" and states > usable:
        lines.append(
            f"  weights, gradients and AdamW states alone take {states:.2f} GiB per device: only more devices "
            f"(or frozen weights) help; shorter sequences or checkpointing cannot"
        )
    if p["suggestions"]:
        lines.append(
            f"  configurations that fit, cheapest first (devices of {memory:.1f} GiB; each as YAML in plan.md, to pass "
            "with --configfile after the run's config):"
        )
        for option in p["suggestions"]:
            lines.append(
                f"    - {option['change']}: {option['num_devices']} device(s), {option['per_device_gib']:.2f} GiB "
                "per device in its worst phase"
            )
    elif p["verdict"] != "fits":
        lines.append(
            f"  no configuration the planner searched (method, layout, checkpointing, micro-batch, devices) fits on "
            f"devices of {memory:.1f} GiB"
        )
    return "\n".join(lines)


def step_summary(mem: Mapping[str, int], host: Mapping[str, int]) -> str:
    """The step's terms per device; under CPU offload its sharded state is on the host (``host``)."""
    if "weights" not in mem:
        return f"  per device {_terms(mem)}; on the host (parallel.cpu_offload) {_terms(host)}"
    return (
        f"  per device {_size(mem['total'])} = weights {_size(mem['weights'])} + gradients {_size(mem['gradients'])} + "
        f"AdamW states {_size(mem['optimizer'])} + unsharded layer {_size(mem['unsharded_layer'])} + prefetched "
        f"layer {_size(mem['prefetched_layer'])} + layer gradient reduce {_size(mem['layer_gradient_reduce'])} + "
        f"root unit {_size(mem['root_unit'])} + residual stream {_size(mem['residual_stream'])} + activations "
        f"{_size(mem['activations'])} + loss {_size(mem['loss'])} + runtime {_size(mem['runtime'])}"
    )


def proposals_markdown(options: list[Mapping[str, Any]]) -> list[str]:
    """The proposals (moeflow.plan.proposals), each as the YAML overlay a user passes with ``--configfile``."""
    if not options:
        return []
    lines = ["", "## Configurations that fit, cheapest first", ""]
    for option in options:
        lines += [
            f"{option['num_devices']} device(s), {option['per_device_gib']:.2f} GiB per device in the worst phase, "
            f"{option['step_flops_per_token'] / 1e9:.1f} GFLOP per token, "
            f"{_size(option['bytes_moved_per_micro_batch'])} moved per micro-batch and device:",
            "",
            "```yaml",
            yaml.safe_dump(option["overlay"], sort_keys=False).rstrip(),
            "```",
            "",
        ]
    return lines


def _terms(terms: Mapping[str, int]) -> str:
    """``total = term + term ...`` of a phase's side, the zero terms left out."""
    parts = [f"{k.replace('_', ' ')} {_size(v)}" for k, v in terms.items() if k != "total" and v]
    return f"{_size(terms['total'])} = " + " + ".join(parts) if parts else "0"


def phases_summary(phases: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: each phase's device total per rank and, where there is one, its host side per rank."""
    cells = []
    for name, phase in phases.items():
        host = phase["host_bytes"]["total"]
        cells.append(f"{name} {_size(phase['device_bytes']['total'])}" + (f" (host {_size(host)})" if host else ""))
    return "  per rank and phase: " + ", ".join(cells)


def host_summary(host: Mapping[str, Any], phases: Mapping[str, Mapping[str, Any]]) -> str:
    worst = phases[host["phase"]]
    side = worst["host_bytes"] if worst["host_bytes"]["total"] else worst["device_bytes"]
    return (
        f"  host per node, worst phase {host['phase']}: {_size(host['per_node_bytes'][host['phase']])} = "
        f"{host['ranks_per_node']} rank(s) x ({_terms(side)}); "
        f"{host['verdict'].replace('_', ' ')} in {_size(host['limit_bytes'])} ({host['limit_source']})"
    )


def enforce(p: Mapping[str, Any]) -> None:
    """Fail when the job's worst phase does not fit on its devices, or a node's ranks do not fit in its
    host memory (the training job's ``mem_mb``; this machine's RAM when the ranks run here, on CPU, or hold their
    state in it, ``parallel.cpu_offload``), with the phase, its terms and the options; warn when either is tight
    (or the host side exceeds this machine's RAM, which is not where GPU ranks run)."""
    worst = p["worst_phase"]
    if p["verdict"] == "does_not_fit":
        refused = {name: phase for name, phase in p["phases"].items() if phase["verdict"] == "does_not_fit"}
        raise PlanError(
            f"the training job does not fit in memory in its {', '.join(refused)} phase(s) (worst: {worst}):\n"
            + "\n".join(f"  {name} per device: {_terms(phase['device_bytes'])}" for name, phase in refused.items())
            + "\n"
            + summary(p)
        )
    host = p["host"]
    binding = host["limit_source"] == MEM_MB_SOURCE or p["job"]["device"] == "cpu" or p["job"].get("cpu_offload", False)
    if host["verdict"] == "does_not_fit" and binding:
        raise PlanError(
            f"the training job's {host['ranks_per_node']} rank(s) per node do not fit in the host memory of "
            f"{_size(host['limit_bytes'])} ({host['limit_source']}) in its {host['phase']} phase:\n" + summary(p)
        )
    if p["verdict"] == "tight":
        log.warning(
            "the training job fits with less than %d%% headroom in its %s phase:\n%s",
            round(HEADROOM * 100),
            worst,
            summary(p),
        )
    elif host["verdict"] != "fits":
        log.warning(
            "the host memory of a node leaves less than %d%% headroom in the %s phase:\n%s",
            round(HEADROOM * 100),
            host["phase"],
            summary(p),
        )


def render_markdown(p: Mapping[str, Any]) -> str:
    params, mem = p["parameters"], p["per_device_bytes"]
    rows = [f"| {k} | {v:,} |" for k, v in params["by_category"].items()]
    mem_rows = [f"| {k.replace('_', ' ')} | {_size(v)} | {v:,} |" for k, v in mem.items()]
    host = p["host"]
    host_rows = [f"| {k} | {_size(v)} | {v:,} |" for k, v in host["per_node_bytes"].items()]
    host_rows.append(f"| limit ({host['limit_source']}) | {_size(host['limit_bytes'])} | {host['limit_bytes']:,} |")
    phases = p["phases"]
    terms = list(dict.fromkeys(k for phase in phases.values() for k in (*phase["device_bytes"], *phase["host_bytes"])))
    terms = sorted((k for k in terms if k != "total"), key=lambda k: k == "runtime")  # the runtime last

    def cell(phase: Mapping[str, Any], side: str, term: str) -> str:
        return _size(phase[side][term]) if phase[side].get(term) else ""

    def row(label: str, cells: Any) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    phase_rows = [
        row(f"{side.split('_')[0]}: {k.replace('_', ' ')}", (cell(ph, side, k) for ph in phases.values()))
        for side in ("device_bytes", "host_bytes")
        for k in terms
        if any(ph[side].get(k) for ph in phases.values())
    ]
    formula = "agrees" if params["formula_matches"] else f"differs: {params['formula_total']:,}"
    return (
        "\n".join(
            [
                f"# Memory plan: {p['model_type']}",
                "",
                "```",
                summary(p),
                "```",
                "",
                f"## Parameters ({params['method']} count; formula {formula})",
                "",
                "| category | parameters |",
                "|---|---|",
                *rows,
                f"| **total** | {params['total']:,} |",
                f"| active per token | {params['active_per_token']:,} |",
                f"| active per token without embeddings | {params['active_per_token_without_embeddings']:,} |",
                "",
                f"## Memory per rank and phase (worst: {p['worst_phase']})",
                "",
                row("term", phases),
                "|---|" + "---|" * len(phases),
                *phase_rows,
                row("**device total**", (_size(ph["device_bytes"]["total"]) for ph in phases.values())),
                row("**host total**", (_size(ph["host_bytes"]["total"]) for ph in phases.values())),
                row("verdict", (ph["verdict"].replace("_", " ") for ph in phases.values())),
                "",
                "## Memory per device, step",
                "",
                "| component | size | bytes |",
                "|---|---|---|",
                *mem_rows,
                "",
                f"## Host memory per node by phase ({host['ranks_per_node']} rank(s); worst: {host['phase']})",
                "",
                "| component | size | bytes |",
                "|---|---|---|",
                *host_rows,
                "",
                "The formulas are in the docstring of `moeflow.plan`.",
                *proposals_markdown(p["suggestions"]),
                *(
                    [
                        "",
                        "## LoRA adapters",
                        "",
                        "| category | adapter parameters |",
                        "|---|---|",
                        *[f"| {k} | {v:,} |" for k, v in p["lora"]["by_category"].items() if v],
                        f"| router weights trained in full | {p['lora']['router_weights']:,} |",
                        f"| **trainable** | {p['lora']['trainable']:,} |",
                    ]
                    if "lora" in p
                    else []
                ),
            ]
        )
        + "\n"
    )
