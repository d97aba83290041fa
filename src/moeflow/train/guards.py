"""Guards that stop a training run early and say why: routing health, memory leaks, non-finite losses.

* ``RoutingGuard``: per MoE layer, each step, the load's max/mean ratio, coefficient of variation,
  normalised load entropy, router entropy and dead experts over a sliding window of steps. A layer
  whose window breaks a threshold raises an alarm; ``report()`` is the warmup stage's stability gate.
  With ``reference: base`` the thresholds are relative to the base model's own routing (``base_reference``:
  its load on the rows of the warmup's gate window, routed before any update, so an unchanged router
  compares equal and any difference is the update's, not sampling noise nor a pretrained model's hot
  experts); until the guard has that reference it judges nothing. ``reference: absolute``: fixed thresholds.
  A loss that falls fast while router entropy collapses early in training gets a warning.
* ``MemoryGuard``: the least-squares slope of memory (RSS on CPU, each step's peak allocated memory on CUDA)
  over a window of steps after a settling period, less twice its standard error (per-step noise is no
  growth), the largest rank's on every rank; a rate above the threshold warns, and one that stays above it
  for ``patience`` steps stops training (every rank) with the step range, the rank and the rate.
* ``check_finite``: a NaN or Inf loss stops training (the last good checkpoint is kept).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from moeflow.data.order import DataOrder
from moeflow.evaluation.routing_stats import expert_load, layer_health
from moeflow.model.routing import adapter_or_none
from moeflow.model.wrappers import unwrap
from moeflow.parallel.layouts import reshard
from moeflow.parallel.process_group import gather_floats
from moeflow.train.settings import MemoryThresholds, RoutingThresholds, TrainSettings

log = logging.getLogger("moeflow.train.guards")


class TrainingStopped(RuntimeError):
    """Training was stopped by a guard; ``report`` says why."""

    def __init__(self, message: str, report: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.report = dict(report or {})


class NonFiniteLoss(TrainingStopped):
    pass


class MemoryLeak(TrainingStopped):
    pass


class UnstableRouting(TrainingStopped):
    pass


def check_finite(values: Mapping[str, float], step: int) -> None:
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise NonFiniteLoss(
            f"step {step}: non-finite {', '.join(f'{k}={v}' for k, v in sorted(bad.items()))}; training stopped, "
            "the last good checkpoint is kept (lower train.lr, check the data, or set train.detect_anomaly)",
            {"step": step, "values": {k: str(v) for k, v in bad.items()}},
        )


class RoutingGuard:
    """Routing health over a sliding window of steps; alarms per layer, and the warmup gate's report."""

    def __init__(self, thresholds: RoutingThresholds):
        self.t = thresholds
        self.window: deque[list[list[int]]] = deque(maxlen=max(1, thresholds.window_steps))
        self.reference: list[list[int]] | None = None  # the base model's load per layer (reference: base)
        self.first: dict[str, float] | None = None
        self.alarmed: set[int] = set()
        self.early_warned = False

    def observe(
        self, step: int, counts: Sequence[Sequence[int]], router_entropy: Sequence[float], ce: float
    ) -> list[str]:
        """Record one step; return the alarms and warnings it raised (also logged)."""
        self.window.append([list(map(int, row)) for row in counts])
        messages = []
        if len(self.window) == self.window.maxlen:
            for problem in self.problems():
                if problem["layer"] not in self.alarmed:
                    self.alarmed.add(problem["layer"])
                    messages.append(f"routing alarm at step {step}: {problem['message']}")
        mean_entropy = sum(router_entropy) / len(router_entropy) if router_entropy else 0.0
        if self.first is None:
            self.first = {"ce": ce, "entropy": mean_entropy}
        elif not self.early_warned and step < self.t.early_steps and self.first["ce"] > 0 and self.first["entropy"] > 0:
            loss_drop = 1 - ce / self.first["ce"]
            entropy_drop = 1 - mean_entropy / self.first["entropy"]
            if loss_drop > self.t.early_loss_drop and entropy_drop > self.t.early_entropy_drop:
                self.early_warned = True
                messages.append(
                    f"routing warning at step {step}: the loss fell {loss_drop:.0%} while router entropy fell "
                    f"{entropy_drop:.0%} since the first step; routing may have failed rather than the model learned"
                )
        for message in messages:
            log.warning(message)
        return messages

    def window_load(self) -> list[list[int]]:
        if not self.window:
            return []
        layers = len(self.window[0])
        return [
            [sum(step[layer][e] for step in self.window) for e in range(len(self.window[0][layer]))]
            for layer in range(layers)
        ]

    def set_reference(self, load: Sequence[Sequence[int]] | None) -> None:
        """The base model's load per MoE layer (``base_reference``), judged against with ``reference: base``."""
        self.reference = None if load is None else [list(map(int, row)) for row in load]

    def _absolute_reasons(self, h: Mapping[str, Any]) -> list[str]:
        reasons = []
        if h["max_over_mean"] > self.t.max_load_ratio:
            reasons.append(f"busiest expert gets {h['max_over_mean']:.2f}x the mean load (max {self.t.max_load_ratio})")
        if h["load_entropy"] < self.t.min_load_entropy:
            reasons.append(f"normalised load entropy {h['load_entropy']:.3f} (min {self.t.min_load_entropy})")
        if len(h["dead_experts"]) > self.t.max_dead_experts:
            reasons.append(f"dead experts {h['dead_experts']} (at most {self.t.max_dead_experts} allowed)")
        return reasons

    def _relative_reasons(self, h: Mapping[str, Any], base: Mapping[str, Any]) -> list[str]:
        reasons = []
        limit = self.t.max_load_ratio_growth * base["max_over_mean"]
        if h["max_over_mean"] > limit:
            reasons.append(
                f"busiest expert gets {h['max_over_mean']:.2f}x the mean load, "
                f"the base model's {base['max_over_mean']:.2f}x grown past {self.t.max_load_ratio_growth}x"
            )
        drop = base["load_entropy"] - h["load_entropy"]
        if drop > self.t.max_load_entropy_drop:
            reasons.append(
                f"normalised load entropy {h['load_entropy']:.3f} fell {drop:.3f} below the base model's "
                f"{base['load_entropy']:.3f} (at most {self.t.max_load_entropy_drop})"
            )
        died = sorted(set(h["dead_experts"]) - set(base["dead_experts"]))
        if len(died) > self.t.max_dead_experts:
            reasons.append(
                f"dead experts {died} that the base model routed tokens to (at most {self.t.max_dead_experts} allowed)"
            )
        return reasons

    def problems(self) -> list[dict[str, Any]]:
        if self.t.reference == "base" and self.reference is None:
            return []
        out = []
        for layer, load in enumerate(self.window_load()):
            h = layer_health(load)
            if self.t.reference == "base":
                reasons = self._relative_reasons(h, layer_health(self.reference[layer]))
            else:
                reasons = self._absolute_reasons(h)
            if reasons:
                out.append(
                    {
                        "layer": layer,
                        "message": f"MoE layer {layer}: "
                        + "; ".join(reasons)
                        + f" over the last {len(self.window)} steps",
                    }
                )
        return out

    def report(self) -> dict[str, Any]:
        """Per-layer health over the window, the problems found and whether routing is stable."""
        problems = self.problems()
        return {
            "window_steps": len(self.window),
            "thresholds": asdict(self.t),
            "layers": [layer_health(load) for load in self.window_load()],
            "base_layers": None if self.reference is None else [layer_health(load) for load in self.reference],
            "problems": [p["message"] for p in problems],
            "stable": not problems,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": list(self.window),
            "reference": self.reference,
            "first": self.first,
            "alarmed": sorted(self.alarmed),
            "early_warned": self.early_warned,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window.clear()
        self.window.extend(state.get("window", []))
        self.set_reference(state.get("reference"))
        self.first = state.get("first")
        self.alarmed = set(state.get("alarmed", []))
        self.early_warned = bool(state.get("early_warned", False))


def gate_window_rows(num_rows: int, seed: int, settings: TrainSettings, world_size: int) -> list[int]:
    """The rows (all ranks') that the last ``window_steps`` of ``settings.steps`` steps train on, in the
    Trainer's data order (``moeflow.data.order``, ``rows_per_step`` per rank and step)."""
    per_step = settings.rows_per_step * world_size
    window = min(settings.routing_guard.window_steps, settings.steps)
    order = DataOrder(num_rows, seed, settings.order)
    order.take(per_step * (settings.steps - window))
    return order.take(per_step * window)


def base_reference(
    model: Any,
    rows: Sequence[Mapping[str, Any]],
    settings: TrainSettings,
    seed: int,
    world_size: int,
    attn_implementation: str,
    precision: str,
) -> list[list[int]] | None:
    """The base model's load per MoE layer on the rows of the gate's window, routed before any update
    (no grad, eval mode; every rank routes them all, so every rank holds the same reference): the
    ``reference: base`` of ``RoutingGuard``. None for a model without MoE layers. The model is left as it
    came, in train mode and resharded: FSDP2 (ours, and transformers' expert-parallel units of the norm and
    head, which do not reshard after forward) keeps the root unit gathered after a forward without backward,
    and an optimizer built then would hold the gathered copies instead of the shards."""
    adapter = adapter_or_none(unwrap(model))
    if adapter is None:
        return None
    window = [rows[i] for i in gate_window_rows(len(rows), seed, settings, world_size)]
    batch_tokens = settings.micro_batch_size * len(window[0]["input_ids"])
    load = expert_load(model, window, batch_tokens, attn_implementation, precision, adapter)
    reshard(model)
    model.train()
    return load


class MemoryGuard:
    """Stop when memory keeps growing across steps (a leak), with the step range, the rank and the rate;
    every rank decides the same.

    The rate over a window of ``window_steps`` steps is the lower end of the least-squares slope's ~95%
    interval (:func:`leak_rate`: the slope less twice its standard error from the residuals): a steady leak
    (RSS on the CPU) has no residuals and is judged at its slope, while a step's peak that moves with what
    it routes (under expert parallelism by 100+ MiB from step to step) widens the interval instead of
    passing for growth; a longer window narrows it. The ranks' rates are exchanged each step
    (``moeflow.parallel.process_group.gather_floats``) and the largest is judged on every rank, so a leak on
    one rank stops all of them together with one message, rather than one rank raising while the others
    wait in the next collective."""

    def __init__(self, thresholds: MemoryThresholds):
        self.t = thresholds
        self.samples: deque[tuple[int, float]] = deque(maxlen=max(2, thresholds.window_steps))
        self.seen = 0
        self.over = 0

    def observe(self, step: int, memory_mib: float) -> float | None:
        """Record memory after a step; once the window is full (a collective from then on: every rank calls
        it each step) return the largest rank's rate (MiB/step)."""
        self.seen += 1
        if self.seen <= self.t.skip_steps:
            return None
        self.samples.append((step, memory_mib))
        if len(self.samples) < self.samples.maxlen:
            return None
        steps, mib = zip(*self.samples)
        slope, error = leak_rate(steps, mib)
        rates = gather_floats(slope - 2 * error)
        rate = max(rates)
        if rate <= self.t.max_slope_mib_per_step:
            self.over = 0
            return rate
        self.over += 1
        worst = rates.index(rate)
        report = {
            "first_step": steps[0],
            "last_step": steps[-1],
            "slope_mib_per_step": rate,
            "rank": worst,
            "rank_slopes_mib_per_step": rates,
            "threshold_mib_per_step": self.t.max_slope_mib_per_step,
            "memory_mib": list(mib),  # this rank's
            "steps_over_threshold": self.over,
        }
        on_rank = f" on rank {worst}" if len(rates) > 1 else ""
        message = (
            f"memory grows {rate:.1f} MiB/step{on_rank} over steps {steps[0]}-{steps[-1]} "
            f"(threshold {self.t.max_slope_mib_per_step} MiB/step)"
        )
        if self.over >= self.t.patience:
            raise MemoryLeak(f"memory leak: {message} for {self.over} steps; training stopped", report)
        log.warning("possible memory leak: %s", message)
        return rate


def leak_rate(steps: Sequence[float], mib: Sequence[float]) -> tuple[float, float]:
    """The least-squares slope of ``mib`` over ``steps`` and its standard error (from the residuals; 0 with
    two points)."""
    n = len(steps)
    mx, my = sum(steps) / n, sum(mib) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    if not sxx:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(steps, mib)) / sxx
    if n <= 2:
        return slope, 0.0
    residuals = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(steps, mib))
    return slope, math.sqrt(residuals / (n - 2) / sxx)
