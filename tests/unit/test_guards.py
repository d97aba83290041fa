"""The guards: a leaking step, a non-finite loss and a collapsing router stop or warn, quiet memory stays quiet,
peaks that move with the routing are no leak, and on two gloo ranks a leak on one stops both at the same step."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks  # noqa: E402
from tiny_training import make_trainer, settings  # noqa: E402

from moeflow.checkpoint.state import latest_checkpoint
from moeflow.settings import typed
from moeflow.train import guards as G
from moeflow.train.settings import MemoryThresholds, RoutingThresholds


def test_memory_guard_stops_a_leaking_step():
    leaked = []

    def leak(step, model):
        leaked.append(torch.ones(6 * 2**20 // 4).add_(step))  # 6 MiB kept alive per step

    trainer = make_trainer(
        step_hook=leak,
        train_settings=settings(
            steps=20, memory_guard={"skip_steps": 1, "window_steps": 4, "max_slope_mib_per_step": 2.0, "patience": 3}
        ),
    )
    with pytest.raises(G.MemoryLeak) as err:
        trainer.run()
    report = err.value.report
    assert report["slope_mib_per_step"] > 4 and report["last_step"] - report["first_step"] == 3
    assert report["last_step"] < 20 and "MiB/step over steps" in str(err.value)


def test_memory_guard_is_quiet_on_flat_memory(caplog):
    guard = G.MemoryGuard(MemoryThresholds(skip_steps=2, window_steps=4, max_slope_mib_per_step=1, patience=2))
    with caplog.at_level("WARNING", logger="moeflow.train.guards"):
        rates = [guard.observe(step, 1000.0 + (step % 2) * 0.5) for step in range(20)]
    # skipped steps and a filling window report nothing; from then on every step reports a small slope
    assert rates[:5] == [None] * 5 and all(r is not None and abs(r) <= 0.5 for r in rates[5:])
    assert guard.over == 0 and [s for s, _ in guard.samples] == [16, 17, 18, 19]
    assert not caplog.records


def routing_noise(steps: int, seed: int = 0, leak: float = 0.0) -> list[float]:
    """Peak memory under expert parallelism: a floor, a leak, and what each step routes (0-400 MiB above it)."""
    g = torch.Generator().manual_seed(seed)
    return [20_000.0 + leak * s + 400 * float(torch.rand((), generator=g)) for s in range(steps)]


def memory_thresholds() -> MemoryThresholds:
    return typed(MemoryThresholds, {})  # the schema's defaults: 10 steps, 16 MiB/step, patience 5


def test_peaks_that_move_with_the_routing_are_no_leak_but_a_leak_under_them_is():
    quiet, leaking = G.MemoryGuard(memory_thresholds()), G.MemoryGuard(memory_thresholds())
    for step, mib in enumerate(routing_noise(200), 1):
        rate = quiet.observe(step, mib)
        assert rate is None or rate <= memory_thresholds().max_slope_mib_per_step, step
    # a least-squares slope through the same peaks crosses 16 MiB/step in many windows
    peaks, window = routing_noise(200), memory_thresholds().window_steps
    xs = torch.arange(window, dtype=torch.float64)
    slopes = [
        float(((xs - xs.mean()) * (torch.tensor(peaks[i : i + window]) - sum(peaks[i : i + window]) / window)).sum())
        / float(((xs - xs.mean()) ** 2).sum())
        for i in range(len(peaks) - window)
    ]
    assert sum(s > memory_thresholds().max_slope_mib_per_step for s in slopes) > 10
    with pytest.raises(G.MemoryLeak, match="memory leak: memory grows"):
        for step, mib in enumerate(routing_noise(200, leak=100.0), 1):
            leaking.observe(step, mib)


def _memory_rank(rank: int, init_file: str, results: dict) -> None:
    """Rank 0's peaks move with its routing; rank 1 leaks 100 MiB a step under the same kind of noise."""
    import torch.distributed as dist

    from moeflow.parallel.process_group import destroy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        guard = G.MemoryGuard(memory_thresholds())
        memory = routing_noise(100, seed=rank, leak=100.0 * rank)
        try:
            for step, mib in enumerate(memory, 1):
                guard.observe(step, mib)
            results[rank] = None
        except G.MemoryLeak as stopped:
            results[rank] = (stopped.report["last_step"], stopped.report["rank"], str(stopped))
    finally:
        destroy()


def test_a_leak_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    results = run_ranks(_memory_rank, str(tmp_path / "init"))
    assert results[0] is not None and results[0] == results[1], results  # the same verdict, step and message
    assert results[0][1] == 1 and "on rank 1" in results[0][2]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    def poison(step, model):
        if step == 3:
            with torch.no_grad():
                model.model.embed_tokens.weight[:, 0] = float("nan")

    trainer = make_trainer(step_hook=poison, checkpoint_dir=tmp_path, train_settings=settings(checkpoint_every=2))
    with pytest.raises(G.NonFiniteLoss, match="step 4: non-finite"):
        trainer.run()
    assert latest_checkpoint(tmp_path).name == "step-00000002"


def test_absolute_routing_guard_flags_collapse_and_dead_experts():
    guard = G.RoutingGuard(
        typed(
            RoutingThresholds,
            {
                "window_steps": 2,
                "max_load_ratio": 2.0,
                "min_load_entropy": 0.5,
                "max_dead_experts": 0,
                "reference": "absolute",
            },
        )
    )
    guard.observe(1, [[10, 10, 10, 10], [40, 0, 0, 0]], [1.3, 0.1], 5.0)
    alarms = guard.observe(2, [[9, 11, 10, 10], [40, 0, 0, 0]], [1.3, 0.1], 4.9)
    assert len(alarms) == 1 and "MoE layer 1" in alarms[0] and "dead experts [1, 2, 3]" in alarms[0]
    report = guard.report()
    assert not report["stable"] and report["layers"][1]["max_over_mean"] == 4.0
    assert report["layers"][0]["load_entropy"] > 0.99


def test_routing_guard_warns_when_loss_falls_fast_while_entropy_collapses():
    guard = G.RoutingGuard(typed(RoutingThresholds, {"window_steps": 50, "early_steps": 10}))
    guard.observe(1, [[5, 5]], [0.69], 8.0)
    messages = guard.observe(2, [[5, 5]], [0.1], 2.0)
    assert any("routing may have failed" in m for m in messages)


# a pretrained router's hot expert: 4x the mean load, over the absolute max_load_ratio of 3
SKEWED_BASE = [[40, 10, 8, 6, 6, 4, 4, 2], [12, 12, 10, 10, 10, 10, 8, 8]]


def base_guard(**thresholds):
    guard = G.RoutingGuard(typed(RoutingThresholds, {"window_steps": 2, **thresholds}))
    guard.set_reference(SKEWED_BASE)
    return guard


def test_base_reference_passes_an_unchanged_router_from_a_skewed_base():
    guard = base_guard()
    for step in (1, 2):
        assert guard.observe(step, [[20, 5, 4, 3, 3, 2, 2, 1], [6, 6, 5, 5, 5, 5, 4, 4]], [1.0, 1.3], 5.0) == []
    report = guard.report()
    assert report["stable"] and report["base_layers"][0]["max_over_mean"] == 4.0
    absolute = G.RoutingGuard(typed(RoutingThresholds, {"window_steps": 2, "reference": "absolute"}))
    absolute.window.extend(guard.window)
    assert not absolute.report()["stable"]  # the same routing fails the absolute thresholds


def test_base_reference_fails_a_collapse():
    guard = base_guard()
    guard.observe(1, [[40, 0, 0, 0, 0, 0, 0, 0], [6, 6, 5, 5, 5, 5, 4, 4]], [0.1, 1.3], 5.0)
    alarms = guard.observe(2, [[40, 0, 0, 0, 0, 0, 0, 0], [6, 6, 5, 5, 5, 5, 4, 4]], [0.1, 1.3], 5.0)
    assert len(alarms) == 1 and "MoE layer 0" in alarms[0]
    assert "the base model's 4.00x grown past 1.5x" in alarms[0] and "fell" in alarms[0]
    assert "dead experts [1, 2, 3, 4, 5, 6, 7] that the base model routed tokens to" in alarms[0]
    assert not guard.report()["stable"]


def test_base_reference_fails_an_expert_that_died_but_not_one_dead_in_the_base():
    guard = base_guard(max_load_ratio_growth=10.0, max_load_entropy_drop=1.0)  # only dead experts judged
    guard.set_reference([[60, 20, 12, 8], [30, 30, 40, 0]])
    window = [[40, 30, 30, 0], [30, 30, 40, 0]]  # layer 0's expert 3 died; layer 1's was dead in the base
    guard.observe(1, window, [1.0, 1.0], 5.0)
    guard.observe(2, window, [1.0, 1.0], 5.0)
    assert guard.report()["problems"] == [
        "MoE layer 0: dead experts [3] that the base model routed tokens to (at most 0 allowed) over the last 2 steps"
    ]


def test_base_reference_travels_in_the_state_and_judges_nothing_without_one():
    guard = base_guard()
    state = guard.state_dict()
    restored = G.RoutingGuard(guard.t)
    for step in (1, 2):
        restored.observe(step, [[50, 0, 0, 0]], [0.1], 5.0)
    assert restored.report()["stable"] and restored.report()["base_layers"] is None  # no reference yet
    restored.load_state_dict(state)
    assert restored.reference == SKEWED_BASE


def test_base_reference_is_the_base_models_load_on_the_gate_windows_rows():
    """An (all but) unchanged router's gate window equals the reference count for count: same rows, same tokens."""
    s = settings(steps=5, warmup_steps=5, lr=1e-12, min_lr=1e-12, routing_guard={"window_steps": 2})
    trainer = make_trainer(train_settings=s)
    reference = G.base_reference(
        trainer.model, trainer.rows, s, seed=0, world_size=1, attn_implementation="sdpa", precision="fp32"
    )
    trainer.model.train()
    trainer.run()
    trainer.routing_guard.set_reference(reference)
    assert trainer.routing_guard.window_load() == reference
    report = trainer.routing_guard.report()
    assert report["stable"] and report["layers"] == report["base_layers"]
