"""The experts implementation chosen by measurement, for ``model.experts_implementation: auto``.

Rule choose_experts times the forward and backward of one MoE block at a run's layer shape, on its device
and in its precision, under each experts implementation this stack runs (transformers 5: eager, grouped_mm,
batched_mm; transformers 4.57: its per-expert loop only, named eager). The block is made without the model:
the model is built on the meta device, its first MoE layer found through moeflow.model.routing's adapter, and only
that module materialised (``to_empty``, then seeded random weights). In transformers 5 the experts read
``config._experts_implementation`` at every call, so one block serves every implementation.

* Only what the model's experts really run is offered: an implementation is not timed where the model class
  opts out of transformers' switch (``from_pretrained`` with it would raise), and one whose experts function
  is not called while its timing runs (the experts' forward silently ran its own loop) is not eligible.
  A configured (not ``auto``) implementation the model cannot run is refused with the reason.
* Only an implementation whose output and gradients (input and weights) agree with eager's within
  TOLERANCE is eligible.
* One whose first call takes over BUDGET_FACTOR times the best median so far is dropped unrepeated
  (batched_mm copies the expert weights per token: 11-20 s a call at 4,096 tokens on a 2-core CPU). A
  median, not a single call, is the yardstick, and the factor is wide: on a shared machine one call can
  take 17x another.
* The block is timed as training holds it (:func:`weights_dtype`): bf16 weights where FSDP's mixed precision
  gathers them in bf16 (``precision: bf16`` with ``parallel.strategy`` fsdp or ep), fp32 weights under autocast
  where every rank holds the fp32 model (``none``); under ``ep`` with the experts of one rank
  (``num_experts / ep_size``, each receiving the tokens its rank's all-to-all sends it).
* Reproducible: the same config on the same kind of machine gives the same choice, however busy the machine.
  After each eligible implementation's first calls, ROUNDS rounds time every eligible one once per round in a
  rotating order, so a change of machine load hits all of them alike; an implementation replaces the current
  choice (eager, the reference, first; then the others in their stable order) only if the median over the
  rounds of its per-round speedup is at least MIN_SPEEDUP. Close timings keep the earlier one: they would flip
  between reruns, and every flip would rerun training (and change its losses). On the CPU the choice is eager
  whatever the timings (:func:`decide`): a shared host's timings flip even so. The report says how to pin the
  choice (``model.experts_implementation``), which skips the race.

Two outputs: the choice (:func:`choice_record`: the implementation and the shape it was chosen for, no
timings), which every rule that loads the model takes as input and moeflow.loading.factory.make_model applies
(its ``experts``); and the timings (:func:`measure`'s report, with the reasons), which only the reports read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from moeflow.families.family import EXPERT_COUNT_KEYS
from moeflow.model.configs import causal_lm_class, transformers_config
from moeflow.model.folder import ModelError
from moeflow.model.routing import adapter_or_none
from moeflow.model.settings import AUTO_EXPERTS, STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.runtime import compat
from moeflow.runtime.env import experts_implementations, torch_facts
from moeflow.settings import enum

REFERENCE = "eager"


REPEATS = 3


# Interleaved rounds behind the choice (every eligible implementation once per round).
ROUNDS = 5


# batched_mm is about 100x slower at real shapes; one call on a busy 2-core machine can take 17x another.
BUDGET_FACTOR = 30.0


MIN_SPEEDUP = 1.25


# max |x - eager's| / max |eager's|, for the output and each gradient; bf16 autocast rounds each product.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


INIT_STD = 0.02


LOOP_V4 = "transformers 4.57's per-expert loop, the only experts implementation it has"


# One forward and backward of the block under an implementation: its output and gradients.
Run = Callable[[str], "tuple[torch.Tensor, list[torch.Tensor]]"]


@dataclasses.dataclass
class MoEBlock:
    """The first MoE layer of a model, materialised alone on ``device``; the rest of the model is on meta."""

    model: torch.nn.Module
    module: torch.nn.Module
    shape: dict[str, Any]
    device: torch.device


def candidates(device: torch.device) -> list[str]:
    """The implementations to time here, eager first: those of the config's values (``auto`` aside) that
    moeflow.runtime.env reports as runnable on this stack and device."""
    if not compat.is_transformers_v5():
        return [REFERENCE]
    runnable = experts_implementations(torch_facts()["gpus"] if device.type == "cuda" else [])["implementations"]
    names = [n for n in enum("#/properties/model/properties/experts_implementation") if n != AUTO_EXPERTS]
    return sorted((n for n in names if runnable[n]["available"]), key=lambda n: n != REFERENCE)


class SilentFallback(RuntimeError):
    """The experts' forward did not call the implementation it was switched to (it ran its own loop)."""


def offered(model: torch.nn.Module, names: list[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """``names`` without the implementations the model class cannot take, and those with the reason: a class
    that opts out of transformers' experts switch raises at load for grouped_mm and ignores the others."""
    if not compat.is_transformers_v5() or type(model)._can_set_experts_implementation():
        return list(names), {}
    reason = (
        f"not offered: {type(model).__name__}'s experts opt out of transformers' experts implementations "
        "(from_pretrained raises for grouped_mm; the others would silently run its own loop)"
    )
    return [n for n in names if n == REFERENCE], {
        n: {"eligible": False, "reason": reason} for n in names if n != REFERENCE
    }


@contextlib.contextmanager
def counted_calls(name: str):
    """The calls of transformers' experts function ``name`` while open: a one-element list of the count."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    calls = [0]
    function = ALL_EXPERTS_FUNCTIONS[name]

    def counting(*args, **kwargs):
        calls[0] += 1
        return function(*args, **kwargs)

    ALL_EXPERTS_FUNCTIONS[name] = counting  # the instance's local mapping, over the library-wide one
    try:
        yield calls
    finally:
        del ALL_EXPERTS_FUNCTIONS[name]


def _expert_width(config: Any) -> int | None:
    for key in ("moe_intermediate_size", "intermediate_size"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def weights_dtype(precision: str, strategy: str = "none") -> str:
    """The dtype the experts' weights have while training runs them: bf16 where FSDP's mixed precision gathers
    bf16 parameters (``precision: bf16`` with strategy fsdp or ep, moeflow.parallel.layouts), else fp32 (the
    fp32 model under autocast: transformers' grouped_mm then casts its inputs to the fp32 weights)."""
    return "bf16" if precision == "bf16" and strategy in ("fsdp", "ep") else "fp32"


def rank_config(config: Any, ep_size: int) -> Any:
    """``config`` with the experts of one rank under expert parallelism (``num_experts / ep_size``); the
    group-limited routing of DeepSeek-V3-style routers is dropped when its groups no longer divide them."""
    if ep_size == 1:
        return config
    key = next((k for k in EXPERT_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
    experts = getattr(config, key, None) if key else None
    if not experts or experts % ep_size:
        raise ModelError(
            f"config key 'parallel.ep_size': {ep_size} does not divide the model's {experts} experts "
            f"(model.config {key}): each rank must hold the same number of experts"
        )
    setattr(config, key, experts // ep_size)
    if getattr(config, "n_group", None) and (experts // ep_size) % config.n_group:
        config.n_group, config.topk_group = 1, 1
    return config


def moe_block(
    settings: ModelSettings,
    micro_batch_size: int,
    seq_len: int,
    device: torch.device,
    seed: int = 0,
    weights: str = "fp32",
    ep_size: int = 1,
):
    """The run's first MoE block on ``device`` with seeded weights in ``weights`` (:func:`weights_dtype`; the
    parameters the model class keeps in fp32, ``_keep_in_fp32_modules_strict``, stay fp32) and one rank's
    experts under ``ep_size`` (:func:`rank_config`), or None for a model without MoE layers."""
    config = transformers_config(settings)
    with torch.device("meta"):  # a skeleton to take one block from, fp32 as moeflow holds every model
        model = causal_lm_class().from_config(
            config, torch_dtype=torch.float32, trust_remote_code=settings.trust_remote_code
        )
    adapter = adapter_or_none(model)
    if adapter is None:
        return None
    model_experts = adapter.num_experts
    if ep_size > 1:
        with torch.device("meta"):
            model = causal_lm_class().from_config(
                rank_config(config, ep_size), torch_dtype=torch.float32, trust_remote_code=settings.trust_remote_code
            )
        adapter = adapter_or_none(model)
    site = adapter.sites[0]
    module = site.block.to_empty(device=device)
    generator = torch.Generator().manual_seed(seed)
    keep = [
        re.compile(rf"(^|\.){re.escape(p)}(\.|$)") for p in getattr(model, "_keep_in_fp32_modules_strict", None) or []
    ]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights]
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
            if dtype != torch.float32 and not any(rule.search(name) for rule in keep):
                param.data = param.data.to(dtype)
        for buffer in module.buffers():
            buffer.zero_()
    shape = {
        "model_type": adapter.model_type,
        "layer": site.layer,
        "hidden_size": int(site.weight.shape[1]),
        "expert_width": _expert_width(config),
        "num_experts": model_experts,
        "top_k": adapter.top_k,
        "micro_batch_size": int(micro_batch_size),
        "seq_len": int(seq_len),
        "tokens": int(micro_batch_size) * int(seq_len),
        "weights": weights,
        "ep_size": int(ep_size),
        "experts_per_rank": adapter.num_experts,
    }
    return MoEBlock(model, module, shape, device)


def block_runner(block: MoEBlock, precision: str, seed: int = 0) -> Run:
    """One forward and backward of ``block`` on fixed random inputs and output gradient, under an implementation
    (switched in the experts' config, where transformers 5 reads it at call time)."""
    generator = torch.Generator().manual_seed(seed)
    size = (block.shape["micro_batch_size"], block.shape["seq_len"], block.shape["hidden_size"])
    dtype = torch.bfloat16 if block.shape.get("weights") == "bf16" else torch.float32  # the hidden states' dtype
    inputs = torch.randn(size, generator=generator).to(block.device, dtype)
    cotangent = torch.randn(size, generator=generator).to(block.device, dtype)
    params = list(block.module.parameters())
    configs = [m.config for m in block.module.modules() if hasattr(m, "config")] + [block.model.config]

    def run(name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if compat.is_transformers_v5():
            for config in configs:
                config._experts_implementation = name
        for param in params:
            param.grad = None
        x = inputs.clone().requires_grad_()
        probe = counted_calls(name) if name != REFERENCE and compat.is_transformers_v5() else contextlib.nullcontext()
        with probe as calls, torch.autocast(block.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = block.module(x)
        if calls is not None and not calls[0]:
            raise SilentFallback(
                f"the experts never called {name}: {type(block.module).__name__}'s experts ran their own loop"
            )
        out = out[0] if isinstance(out, tuple) else out  # 4.57's blocks also return the router logits
        out.float().backward(cotangent)
        grads = [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        return out.detach().float(), [g.detach().float() for g in grads]

    return run


def relative_difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest max-abs difference relative to the reference's max-abs, over pairs of tensors."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        scale = float(b.abs().max()) or 1.0
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst


def compare(
    run: Run,
    names: Sequence[str],
    precision: str,
    synchronize: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
):
    """Each implementation of ``names`` (eager first) timed by ``run``: its first call, its difference from eager,
    whether it is eligible and why; for the eligible ones, the times of ROUNDS interleaved rounds (``rounds_s``)
    and their median (``median_s``). ``clock``: seconds (tests plant a machine whose load changes)."""
    if names[0] != REFERENCE:
        raise ValueError(f"the reference {REFERENCE!r} is timed first, got {list(names)}")

    def timed(name: str):
        synchronize()
        start = clock()
        result = run(name)
        synchronize()
        return clock() - start, result

    results: dict[str, dict[str, Any]] = {}
    reference = None
    best = None  # the smallest warm median so far
    for name in names:
        try:
            first, (out, grads) = timed(name)
        except Exception as exc:  # a kernel this device or dtype lacks, or out of memory
            if name == REFERENCE:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            message = str(exc).splitlines()[0] if str(exc) else ""
            silent = isinstance(exc, SilentFallback)
            reason = f"not eligible: {message}" if silent else f"fails here: {type(exc).__name__}: {message}"
            results[name] = {"eligible": False, "reason": reason}
            continue
        if reference is None:
            reference = [out, *grads]
        difference = relative_difference([out, *grads], reference)
        entry: dict[str, Any] = {"first_call_s": first, "max_relative_difference": difference}
        results[name] = entry
        tolerance = TOLERANCE[precision]
        if difference > tolerance:
            entry |= {"eligible": False, "reason": f"differs from eager by {difference:.3g} (tolerance {tolerance:g})"}
            continue
        if best is not None and first > BUDGET_FACTOR * best:
            entry |= {
                "eligible": False,
                "reason": f"first call {first:.3g} s, over {BUDGET_FACTOR:g}x the best median so far "
                f"({best:.3g} s): dropped without repeats",
            }
            continue
        warm = statistics.median(timed(name)[0] for _ in range(REPEATS))
        best = warm if best is None else min(best, warm)
        entry |= {"eligible": True, "reason": f"agrees with eager ({difference:.3g} <= {tolerance:g})"}
    eligible = [n for n in names if results[n]["eligible"]]
    rounds: dict[str, list[float]] = {n: [] for n in eligible}
    for r in range(ROUNDS):  # every eligible one per round, the order rotating: load changes hit all alike
        for name in eligible[r % len(eligible) :] + eligible[: r % len(eligible)]:
            rounds[name].append(timed(name)[0])
    for name in eligible:
        results[name] |= {"rounds_s": rounds[name], "median_s": statistics.median(rounds[name])}
    return results


def speedup(results: Mapping[str, Mapping[str, Any]], faster: str, than: str) -> float:
    """The median over the interleaved rounds of ``than``'s time over ``faster``'s in the same round."""
    return statistics.median(t / f for t, f in zip(results[than]["rounds_s"], results[faster]["rounds_s"], strict=True))


def choose(results: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """The implementation to use and why, from :func:`compare`'s results: eager, replaced by each next eligible
    implementation in the results' (stable) order only where it is at least MIN_SPEEDUP faster than the current
    choice by :func:`speedup`; close timings keep the earlier one (no flip between reruns)."""
    eligible = [n for n, r in results.items() if r["eligible"]]
    timings = ", ".join(f"{n} {results[n]['median_s'] * 1e3:.3g} ms" for n in eligible)
    chosen, kept = eligible[0], []
    for name in eligible[1:]:
        gain = speedup(results, name, chosen)
        if gain >= MIN_SPEEDUP:
            chosen = name
        else:
            kept.append(f"{name} {gain:.2f}x")
    pin = f"pin it with model.experts_implementation: {chosen}"
    if len(eligible) == 1:
        return chosen, f"{chosen} is the only eligible implementation ({timings}); {pin}"
    how = f"medians of {ROUNDS} interleaved rounds: {timings}"
    if kept:
        how += f"; under the {MIN_SPEEDUP:g}x margin over the choice: {', '.join(kept)}"
    if chosen == REFERENCE:
        return chosen, f"eager kept: no other is {MIN_SPEEDUP:g}x faster ({how}); {pin}"
    return chosen, f"{chosen} is the fastest eligible implementation by a clear margin ({how}); {pin}"


def decide(device_type: str, results: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """The choice for a device kind: :func:`choose`'s on a GPU; on the CPU eager, whatever the timings. A shared
    host's CPU timings are not reproducible (on a busy 2-core machine grouped_mm over eager measured 1.1x in one
    run and 1.2x to 6.7x in others at the smoke shape), and the CPU is where tests and smoke runs train."""
    chosen, reason = choose(results)
    if device_type != "cpu" or chosen == REFERENCE:
        return chosen, reason
    return REFERENCE, (
        f"eager on the CPU whatever the timings (CPU timings on a shared host flip between runs; these would pick "
        f"{reason}); pin another with model.experts_implementation"
    )


def measure(
    settings: ModelSettings,
    micro_batch_size: int,
    seq_len: int,
    device: torch.device,
    precision: str,
    strategy: str = "none",
    ep_size: int = 1,
) -> dict[str, Any]:
    """The timing report of a run's MoE block as training runs it (``parallel.strategy`` and ``ep_size``: the
    weights' dtype, one rank's experts): shape, device, precision, each implementation's timings and agreement,
    and the implementation to use with the reason (``configured`` is what the config says)."""
    configured = settings.experts_implementation
    report: dict[str, Any] = {
        "configured": configured,
        "device": device.type,
        "precision": precision,
        "transformers": str(compat.version_of("transformers")),
    }
    weights = weights_dtype(precision, strategy)
    block = moe_block(
        settings, micro_batch_size, seq_len, device, weights=weights, ep_size=ep_size if strategy == "ep" else 1
    )
    if block is None:
        return report | {
            "shape": None,
            "implementations": {},
            "chosen": STACK_DEFAULT_EXPERTS,
            "reason": "the model has no MoE layer: nothing to choose",
        }
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    names, not_offered = offered(block.model, candidates(device))
    results = compare(block_runner(block, precision), names, precision, synchronize) | not_offered
    chosen, reason = decide(device.type, results)
    if not compat.is_transformers_v5():
        reason = f"{LOOP_V4} ({results[REFERENCE]['median_s'] * 1e3:.3g} ms)"
    if configured != AUTO_EXPERTS:
        if configured not in results:
            compat.require_transformers_v5(f"model.experts_implementation: {configured}")
        cannot = results[configured]["reason"]
        if cannot.startswith(("not offered", "not eligible", "fails here")):
            raise ModelError(
                f"config key 'model.experts_implementation': {configured} cannot run for this model ({cannot}); "
                "use auto (what agrees with eager and is fastest here) or eager"
            )
        chosen, reason = configured, f"set by model.experts_implementation (auto would pick {chosen}: {reason})"
    return report | {"shape": block.shape, "implementations": results, "chosen": chosen, "reason": reason}


def choice_record(report: Mapping[str, Any]) -> dict[str, Any]:
    """The choice file's content: what the choice is and what it was made for, nothing that varies by run."""
    return {k: report[k] for k in ("configured", "device", "precision", "shape")} | {"implementation": report["chosen"]}
