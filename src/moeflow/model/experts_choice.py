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
* The choice is the fastest eligible by the median of REPEATS calls, except that eager, the reference, is
  kept unless another is MIN_SPEEDUP times faster: close timings would flip between reruns, and every
  flip would rerun training.

Two outputs: the choice (:func:`choice_record`: the implementation and the shape it was chosen for, no
timings), which every rule that loads the model takes as input and moeflow.model.factory.make_model applies
(its ``experts``); and the timings (:func:`measure`'s report, with the reasons), which only the reports read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from moeflow.model.configs import causal_lm_class, transformers_config
from moeflow.model.folder import ModelError
from moeflow.model.routing import adapter_or_none
from moeflow.model.settings import AUTO_EXPERTS, STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.runtime import compat
from moeflow.runtime.env import experts_implementations, torch_facts
from moeflow.settings import enum

REFERENCE = "eager"


REPEATS = 3


# batched_mm is about 100x slower at real shapes; one call on a busy 2-core machine can take 17x another.
BUDGET_FACTOR = 30.0


MIN_SPEEDUP = 1.10


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


def moe_block(settings: ModelSettings, micro_batch_size: int, seq_len: int, device: torch.device, seed: int = 0):
    """The run's first MoE block on ``device`` with seeded weights, or None for a model without MoE layers."""
    config = transformers_config(settings)
    with torch.device("meta"):  # a skeleton to take one block from, fp32 as moeflow holds every model
        model = causal_lm_class().from_config(
            config, torch_dtype=torch.float32, trust_remote_code=settings.trust_remote_code
        )
    adapter = adapter_or_none(model)
    if adapter is None:
        return None
    site = adapter.sites[0]
    module = site.block.to_empty(device=device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        for buffer in module.buffers():
            buffer.zero_()
    shape = {
        "model_type": adapter.model_type,
        "layer": site.layer,
        "hidden_size": int(site.weight.shape[1]),
        "expert_width": _expert_width(config),
        "num_experts": adapter.num_experts,
        "top_k": adapter.top_k,
        "micro_batch_size": int(micro_batch_size),
        "seq_len": int(seq_len),
        "tokens": int(micro_batch_size) * int(seq_len),
    }
    return MoEBlock(model, module, shape, device)


def block_runner(block: MoEBlock, precision: str, seed: int = 0) -> Run:
    """One forward and backward of ``block`` on fixed random inputs and output gradient, under an implementation
    (switched in the experts' config, where transformers 5 reads it at call time)."""
    generator = torch.Generator().manual_seed(seed)
    size = (block.shape["micro_batch_size"], block.shape["seq_len"], block.shape["hidden_size"])
    inputs = torch.randn(size, generator=generator).to(block.device)
    cotangent = torch.randn(size, generator=generator).to(block.device)
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


def compare(run: Run, names: Sequence[str], precision: str, synchronize: Callable[[], None] = lambda: None):
    """Each implementation of ``names`` (eager first) timed by ``run``: its first call, the median of REPEATS
    more, its difference from eager, whether it is eligible and why."""
    if names[0] != REFERENCE:
        raise ValueError(f"the reference {REFERENCE!r} is timed first, got {list(names)}")

    def timed(name: str):
        synchronize()
        start = time.perf_counter()
        result = run(name)
        synchronize()
        return time.perf_counter() - start, result

    results: dict[str, dict[str, Any]] = {}
    reference = None
    best = None  # the smallest median so far
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
        entry["median_s"] = statistics.median(timed(name)[0] for _ in range(REPEATS))
        best = entry["median_s"] if best is None else min(best, entry["median_s"])
        entry |= {"eligible": True, "reason": f"agrees with eager ({difference:.3g} <= {tolerance:g})"}
    return results


def choose(results: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """The implementation to use and why, from :func:`compare`'s results."""
    eligible = {n: r["median_s"] for n, r in results.items() if r["eligible"]}
    fastest = min(eligible, key=eligible.__getitem__)
    timings = ", ".join(f"{n} {s * 1e3:.3g} ms" for n, s in sorted(eligible.items(), key=lambda item: item[1]))
    if len(eligible) == 1:
        return fastest, f"{fastest} is the only eligible implementation ({timings})"
    if fastest != REFERENCE and eligible[REFERENCE] < MIN_SPEEDUP * eligible[fastest]:
        return REFERENCE, (
            f"eager kept: {fastest} is faster by less than {MIN_SPEEDUP:g}x ({timings}); close timings would "
            "flip the choice between reruns"
        )
    return fastest, f"{fastest} is the fastest eligible implementation ({timings})"


def measure(
    settings: ModelSettings, micro_batch_size: int, seq_len: int, device: torch.device, precision: str
) -> dict[str, Any]:
    """The timing report of a run's MoE block: shape, device, precision, each implementation's timings and
    agreement, and the implementation to use with the reason (``configured`` is what the config says)."""
    configured = settings.experts_implementation
    report: dict[str, Any] = {
        "configured": configured,
        "device": device.type,
        "precision": precision,
        "transformers": str(compat.version_of("transformers")),
    }
    block = moe_block(settings, micro_batch_size, seq_len, device)
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
    chosen, reason = choose(results)
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
