"""The one-line finding each table and figure caption ends with, written from the numbers it shows.

Every finding is a deterministic function of its rows (ties broken by the rows' order), so the same inputs give
the same caption bytes. A table without rows says so; a difference is set against the seed noise where one was
measured (moeflow.paper.noise), and said to lie beyond it or within it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moeflow.paper.eval_results import eval_set, forgetting_changes
from moeflow.paper.noise import beyond, difference, is_number
from moeflow.paper.tables import Table


def num(x: Any) -> str:
    """A difference or a noise as text: two significant digits (``0.29``, ``0.018``), one decimal from 10 up."""
    if not is_number(x):
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2g}"


def signed(x: Any) -> str:
    return num(x) if not is_number(x) or x < 0 else f"+{num(x)}"


def level(x: Any) -> str:
    """A loss or score as text: three decimals."""
    return f"{x:.3f}" if is_number(x) else "n/a"


def pct(fraction: Any) -> str:
    """A fraction as a percentage: whole percents, one significant digit below 1%."""
    if not is_number(fraction):
        return "n/a"
    p = 100 * fraction
    return f"{p:.0f}%" if p == 0 or abs(p) >= 1 else f"{p:.1g}%"


def share(percent: Any) -> str:
    """A table's percentage (``trainable %``) as text."""
    return pct(percent / 100) if is_number(percent) else "n/a"


def named(row: Mapping[str, Any]) -> str:
    """A run with its method where the name does not say it: ``moe (full)``, ``lora``."""
    return row["run"] if row["run"] == row["method"] else f"{row['run']} ({row['method']})"


def owner(row: Mapping[str, Any]) -> str:
    """A run's possessive with its method where the name does not say it: ``moe's (full)``, ``lora's``."""
    return f"{row['run']}'s" if row["run"] == row["method"] else f"{row['run']}'s ({row['method']})"


def apart(diff: float, above: str, below: str) -> str:
    """``is 0.02 nats/token above`` (for a positive ``diff``), ``... below``, or ``equals``."""
    return "equals" if diff == 0 else f"is {num(abs(diff))} nats/token {above if diff > 0 else below}"


def noise_clause(diff: Any, noise: Any) -> str:
    """``, beyond the seed noise of 0.01`` (or ``within``); empty where no noise was measured."""
    verdict = beyond(diff, noise)
    return "" if verdict is None else f", {'beyond' if verdict else 'within'} the seed noise of {num(noise)}"


def finding(text: str) -> str:
    return f"Finding: {text}."


def caption_finding(table: Table) -> str:
    """The finding a table's caption ends with (for the figure that shows the same numbers)."""
    return table.caption[table.caption.rindex("Finding: ") :]


def table_rows(table: Table) -> list[dict[str, Any]]:
    """A table's raw rows as dicts by column."""
    return [dict(zip(table.columns, row)) for row in table.rows]


def numbered(rows: Sequence[Mapping[str, Any]], key: str) -> list[Mapping[str, Any]]:
    return [r for r in rows if is_number(r.get(key))]


def extreme(rows: Sequence[Mapping[str, Any]], key: str, largest: bool = True) -> Mapping[str, Any]:
    """The row with the largest (or smallest) ``key``; the first in order among equals."""
    sign = -1 if largest else 1
    return min(enumerate(rows), key=lambda item: (sign * item[1][key], item[0]))[1]


# --------------------------------------------------------------------------- per-run tables


def final_metrics_finding(table: Table) -> str:
    rows = numbered(table_rows(table), "change")
    if not rows:
        return finding("no rows: no run was evaluated")
    fell = [r for r in rows if r["change"] < 0]
    best = extreme(rows, "change", largest=False)
    forgot = [r for r in table_rows(table) if r["forgetting"]]
    return finding(
        f"fine-tuning lowered the loss on {len(fell)} of {len(rows)} (run, set) pairs, most for {best['run']} on "
        f"{best['set']} ({level(best['base loss'])} -> {level(best['fine-tuned loss'])} nats/token); the loss rose "
        f"on {f'{len(forgot)} set(s)' if forgot else 'no set'} a fine-tune did not target"
    )


def expert_finding(table: Table, set_name: str) -> str:
    rows = [dict(r, shift=difference(r["fine-tuned share"], r["base share"])) for r in table_rows(table)]
    rows = numbered(rows, "shift")
    if not rows:
        return finding(f"no rows: no MoE run has per-expert statistics on the {set_name} set")
    top = extreme([dict(r, size=abs(r["shift"])) for r in rows], "size")
    below = sum(1 for r in table_rows(table) if r["below"])
    return finding(
        f"the largest shift of load is {top['run']}'s layer {top['layer']} expert {top['expert']}, "
        f"{level(top['base share'])} -> {level(top['fine-tuned share'])} of the layer's assignments; {below} (run, "
        "layer, expert) cell(s) are below the coverage threshold with the fine-tuned router"
    )


def balance_finding(table: Table) -> str:
    rows = numbered(table_rows(table), "max/mean")
    if not rows:
        return finding("no rows: no MoE run has expert statistics")
    worst = extreme(rows, "max/mean")
    dead = {model: sum(r["dead experts"] for r in rows if r["model"] == model) for model in ("base", "finetuned")}
    return finding(
        f"the least balanced layer is {worst['run']}'s layer {worst['layer']} ({worst['model']} router), max/mean "
        f"load {worst['max/mean']:.2f}; dead experts over all runs and layers: {dead['base']} base, "
        f"{dead['finetuned']} fine-tuned"
    )


def environment_finding(table: Table) -> str:
    items = {row[0]: row[1] for row in table.rows}
    pins = items.get("pins match")
    return finding(
        f"made on the {items.get('stack')} stack (torch {items.get('torch')}, transformers "
        f"{items.get('transformers')}) in {items.get('precision')} on {items.get('device')}; the environment "
        + (
            "matches the stack's pins"
            if pins is True
            else "differs from the stack's pins"
            if pins is False
            else "was not checked against pins"
        )
    )


def lm_eval_finding(table: Table) -> str:
    rows = [dict(r, size=abs(r["change"])) for r in numbered(table_rows(table), "change")]
    if not rows:
        return finding("no rows: no lm-eval task was run (evaluate.tasks is empty)")
    top = extreme(rows, "size")
    stderr = f" (stderr {top['fine-tuned stderr']:.2g})" if is_number(top["fine-tuned stderr"]) else ""
    return finding(
        f"the largest change is {top['run']}'s {top['task']} {top['metric']}, {top['base']:.4g} -> "
        f"{top['fine-tuned']:.4g}{stderr}"
    )


def humaneval_finding(table: Table) -> str:
    rows = [r for r in numbered(table_rows(table), "fine-tuned") if r["measure"] == "greedy pass@1"]
    if not rows:
        return finding("no rows: no run ran HumanEval")
    top = extreme(rows, "fine-tuned")
    return finding(
        f"the best greedy pass@1 of a fine-tuned model is {top['run']}'s, {top['fine-tuned']:.3f} (its base: "
        f"{top['base']:.3f})"
    )


def drift_finding(rows: Sequence[Mapping[str, Any]]) -> str:
    rows = numbered(rows, "JS divergence")
    if not rows:
        return finding("no rows: no MoE run, so no routing drift")
    top = extreme(rows, "JS divergence")
    return finding(
        f"the largest routing drift is {top['run']}'s layer {top['layer']}: JS divergence "
        f"{top['JS divergence']:.3g} bits, {pct(top['changed expert sets'])} of tokens changed their expert set"
    )


# --------------------------------------------------------------------------- comparisons


def _reference(rows: Sequence[Mapping[str, Any]], reference: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["run"] == reference), None)


def comparison_finding(rows: Sequence[Mapping[str, Any]], reference: str, noise: Mapping[str, float | None]) -> str:
    """MoE vs dense: the MoE's validation loss and target gain against each dense run's."""
    ref = _reference(rows, reference)
    others = [r for r in rows if r["run"] != reference]
    if ref is None or not others:
        return finding(f"no dense run to compare with {reference} (paper.dense_runs is empty)")
    parts = []
    for d in others:
        v = difference(d["val loss"], ref["val loss"])  # positive: the MoE's is lower
        if v is None:
            parts.append(f"{d['run']} has no validation loss to compare")
            continue
        text = (
            f"{reference}'s validation loss {apart(v, 'below', 'above')} {d['run']}'s ({level(ref['val loss'])} "
            f"vs {level(d['val loss'])}{noise_clause(v, noise.get('val loss'))})"
        )
        mine, theirs = ref.get("target loss change"), d.get("target loss change")
        g = difference(theirs, mine)  # gain = -change: positive when the MoE gained more
        if g is not None:
            text += (
                f" and its target-slice gain {num(abs(g))} {'larger' if g >= 0 else 'smaller'} ({num(-mine)} vs "
                f"{num(-theirs)}{noise_clause(g, noise.get('target loss change'))})"
            )
        parts.append(text)
    return finding("; ".join(parts))


def lora_vs_full_finding(rows: Sequence[Mapping[str, Any]], reference: str, noise: Mapping[str, float | None]) -> str:
    """LoRA vs full: each run of another method than the reference's, its parameters, speed and loss at equal tokens."""
    ref = _reference(rows, reference)
    if ref is None:
        return finding(f"no row for {reference}, so nothing is compared with it")
    others = [r for r in rows if r["method"] != ref["method"]]
    if not others:
        return finding(f"every run is trained by {reference}'s method ({ref['method']}): no other method to compare")
    parts = []
    for r in others:
        text = f"{named(r)} trains {share(r['trainable %'])} of the parameters"
        if is_number(r["train tokens/s"]) and is_number(ref["train tokens/s"]) and ref["train tokens/s"]:
            text += f" at {r['train tokens/s'] / ref['train tokens/s']:.2f}x {reference}'s training throughput"
        v = difference(r["val loss at tokens"], ref["val loss at tokens"])
        if v is not None:
            text += f"; at {r['tokens compared']:,} tokens its validation loss {apart(v, 'above', 'below')} "
            text += f"{reference}'s{noise_clause(v, noise.get('val loss at tokens'))}"
        parts.append(text)
    return finding("; ".join(parts))


def methods_finding(rows: Sequence[Mapping[str, Any]], reference: str, noise: Mapping[str, float | None]) -> str:
    """The methods comparison: per run of another method, its share of the parameters, of the reference's target gain
    and of its forgetting, each difference against the seed noise."""
    if not rows:
        return finding("no rows: no MoE run, so no methods to compare")
    ref = _reference(rows, reference)
    if ref is None:
        return finding(f"{reference} has no row (no routing drift), so no method is compared with it")
    others = [r for r in rows if r["method"] != ref["method"]]
    gain, forgetting = ref["target gain"], ref["general forgetting"]
    if not others:
        return finding(f"only {ref['method']} fine-tuning ran: {reference}'s target gain is {num(gain)} nats/token")
    parts = []
    for r in others:
        text = f"{named(r)} trains {share(r['trainable %'])} of the parameters"
        g = difference(r["target gain"], gain)
        if g is not None:
            clause = noise_clause(g, noise.get("target gain"))
            if gain > 0:
                kept = pct(r["target gain"] / gain)
                text += f" and keeps {kept} of {owner(ref)} target gain ({num(r['target gain'])} vs {num(gain)}"
                text += f" nats/token{clause})"
            else:
                text += f" and gains {num(r['target gain'])} nats/token on the target slice against {owner(ref)}"
                text += f" {num(gain)}{clause}"
        f = difference(r["general forgetting"], forgetting)
        if f is not None:
            clause = noise_clause(f, noise.get("general forgetting"))
            mine, theirs = signed(r["general forgetting"]), signed(forgetting)
            if forgetting > 0:
                text += (
                    f", with {pct(r['general forgetting'] / forgetting)} of its forgetting ({mine} vs {theirs}{clause})"
                )
            else:
                text += f", its general-slice loss changing by {mine} against {reference}'s {theirs}{clause}"
        parts.append(text)
    return finding("; ".join(parts))


def forgetting_finding(rows: Sequence[Mapping[str, Any]], noise: Mapping[str, float | None]) -> str:
    """Which runs forgot (the general slice's loss rose), the most of them against the seed noise."""
    known = numbered(rows, "general loss change")
    if not rows:
        return finding("no rows: no run was evaluated")
    if not known:
        return finding("no run was evaluated on the general slice")
    rose = [r for r in known if r["general loss change"] > 0]
    clause = lambda r: noise_clause(r["general loss change"], noise.get("general loss change"))  # noqa: E731
    if rose:
        worst = extreme(rose, "general loss change")
        return finding(
            f"the general-slice loss rose in {len(rose)} of {len(known)} runs, most in {worst['run']} "
            f"({signed(worst['general loss change'])} nats/token{clause(worst)})"
        )
    least = extreme(known, "general loss change")
    return finding(
        f"no run forgot: the general-slice loss rose in none of the {len(known)} runs; the least change for the "
        f"better is {least['run']}'s ({signed(least['general loss change'])} nats/token{clause(least)})"
    )


def seed_noise_finding(moe: Any, twin: Any) -> str:
    """The noise of the target and the general slice's loss change and of the fine-tuned validation loss, from the
    MoE run's record and its reseeded twin's (None, None: not measured)."""
    if moe is None or twin is None:
        return finding("no rows: the seed noise was not measured")
    a, b = forgetting_changes(moe.metrics, moe.results), forgetting_changes(twin.metrics, twin.results)
    va, vb = (eval_set(r.metrics, "valset") for r in (moe, twin))
    change = lambda x: f"{x:+.3f}"  # noqa: E731 (a change's sign matters, a loss has none)
    picked = [
        ("the target slice's loss change", change, a["target loss change"], b["target loss change"]),
        ("the general slice's", change, a["general loss change"], b["general loss change"]),
        ("the fine-tuned validation loss", level, *(v["finetuned"]["loss"] if v else None for v in (va, vb))),
    ]
    picked = [(label, shown, x, y) for label, shown, x, y in picked if difference(x, y) is not None]
    if not picked:
        return finding("the two runs share no measure")
    return finding(
        "the two seeds differ by "
        + ", ".join(
            f"{num(abs(x - y))} nats/token in {label} ({shown(x)} vs {shown(y)})" for label, shown, x, y in picked
        )
    )


# --------------------------------------------------------------------------- figures


def loss_finding(logs: Mapping[str, Any]) -> str:
    """The lowest and the highest last validation loss (training cross-entropy for a run without validation)."""
    ends = []
    for run, log in sorted(logs.items()):
        if log.val_loss:
            ends.append({"run": run, "loss": log.val_loss[-1], "tokens": log.val_tokens[-1], "kind": "validation loss"})
        elif log.ce:
            ends.append({"run": run, "loss": log.ce[-1], "tokens": log.tokens[-1], "kind": "training CE"})
    if not ends:
        return finding("no run logged a step")
    low, high = extreme(ends, "loss", largest=False), extreme(ends, "loss")
    text = f"the lowest last {low['kind']} is {low['run']}'s, {level(low['loss'])} nats/token"
    text += f" after {low['tokens']:,} tokens"
    if high["run"] != low["run"]:
        text += f"; the highest {high['run']}'s, {level(high['loss'])}"
    return finding(text)


def lr_finding(logs: Mapping[str, Any]) -> str:
    """The peak learning rates, and the runs that reach each."""
    peaks: dict[float, list[str]] = {}
    for run, log in sorted(logs.items()):
        if log.lr:
            peaks.setdefault(max(log.lr), []).append(run)
    if not peaks:
        return finding("no run logged a step")
    return finding(
        "peak learning rate " + "; ".join(f"{lr:.2g} ({', '.join(runs)})" for lr, runs in sorted(peaks.items()))
    )


def expert_load_finding(run: str, log: Any) -> str:
    """The busiest expert of the last logged step against a uniform share."""
    if not log.loads or not log.loads[-1]:
        return finding(f"{run} logged no expert load")
    shares = [
        {"layer": layer, "expert": e, "share": n / max(sum(loads), 1), "experts": len(loads)}
        for layer, loads in enumerate(log.loads[-1])
        for e, n in enumerate(loads)
    ]
    top = extreme(shares, "share")
    return finding(
        f"at step {log.steps[-1]} the busiest expert, layer {top['layer']}'s {top['expert']}, takes "
        f"{pct(top['share'])} of its layer's assignments (uniform: {pct(1 / top['experts'])})"
    )


def coverage_finding(coverage: Mapping[str, Any]) -> str:
    valset, random = coverage["valset"], coverage["random_comparison"]
    return finding(
        f"the coverage validation set leaves {valset['cells_below']} (layer, expert) cell(s) and "
        f"{valset['pairs_below']} expert pair(s) below {coverage['settings']['min_docs_per_expert']} documents; random "
        f"subsets of its {valset['tokens']:,} tokens leave {random['cells_below']['mean']:.1f} and "
        f"{random['pairs_below']['mean']:.1f} on average"
    )
