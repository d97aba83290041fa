"""Memory per rank of the forward-only stages, and whether each fits on its section's ranks.

The five stages that run a model without training it (coverage_valset and esft_routing on ``coverage.ranks``;
evaluate_model, lm_eval_task and humaneval_generate on ``evaluate.ranks``) load it in the compute
dtype (bf16 with ``precision: bf16``, moeflow.model.device.compute_dtype) in their section's layout
(moeflow.workflow.keys.forward_parallel) and run forwards without gradients. Per rank and phase:

* load: the rank's share of the weights in the compute width (whole with ``none``; sharded over the ranks with
  fsdp and ep, as training shards them), and on CUDA a host buffer of one tensor's owned rows and the host
  runtime;
* forward: those weights; with fsdp or ep the largest decoder layer gathered while it runs, the next one
  prefetched and the root unit (embedding, output layer, final norm); one decoder layer's tensors at a time for
  a forward's tokens (nothing is kept for a backward pass: the largest layer's, and the residual stream's
  input and sum); the attention masks (moeflow.plan.activations.attention_mask_bytes); what the stage computes at the
  end of the decoder:

  - ``routing`` (every stage but humaneval_generate; lm_eval_task for moeflow_perplexity's cross-check): each MoE
    layer's router scores for the forward's tokens in fp32, captured until the forward ends
    (moeflow.model.routing.capture);
  - ``chunked`` logits (evaluate_model, lm_eval_task: moeflow.model.chunked_loss): one chunk of
    ``model.loss_chunk_tokens`` rows of the vocabulary at a time, never the batch's;
  - ``generate`` (humaneval_generate: transformers' generate, which computes the last position's logits only):
    each sequence's last logits and their fp32 copy, and the KV cache of its prompt (HumanEval's longest, or
    ``data.seq_len``) and ``max_new_tokens`` (every layer's keys and values; MLA's per head, as transformers
    caches them);

  and the runtime (moeflow.plan.memory.runtime_bytes).

:func:`forward_plan` gives the phases' verdicts against one device's memory (moeflow.plan.fit's headroom) and
the smallest rank count at which the stage fits. Each stage calls :func:`refuse_unless_fits` when it starts,
before it loads its model: on a GPU it is refused, naming its section's keys and the ranks it would fit on,
where it would run out of memory (on the CPU, whose memory the ranks share, nothing is checked).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeflow.model.settings import LoraSettings
from moeflow.plan.activations import (
    FP32_BYTES,
    LOSS_BYTES_PER_LOGIT,
    WEIGHT_BYTES,
    attention_mask_bytes,
    layer_activation_elements,
)
from moeflow.plan.counts import ParamCount, count_parameters
from moeflow.plan.fit import gib, verdict
from moeflow.plan.memory import (
    CUDA_HOST_RUNTIME_BYTES,
    Job,
    gathered_unit,
    root_unit_parameters,
    runtime_bytes,
    with_total,
)
from moeflow.plan.shapes import PlanError, Shape
from moeflow.settings import typed

# What each forward-only stage computes after the decoder (module docstring); evaluate_model counts the routing
# (also routing drift's, token by token) and scores the tokens. The section each runs on:
# moeflow.workflow.keys.FORWARD_STAGE_SECTIONS.
COMPUTES: dict[str, tuple[str, ...]] = {
    "coverage_valset": ("routing",),
    "esft_routing": ("routing",),
    "evaluate_model": ("routing", "chunked"),
    "lm_eval_task": ("routing", "chunked"),  # moeflow_perplexity's cross-check evaluates with routing captured
    "humaneval_generate": ("generate",),
}

FORWARD_PHASES = ("load", "forward")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardJob:
    """A forward-only stage's job per rank: its layout and batch as a training :class:`Job` holds them (``Job``'s
    ``micro_batch_size`` sequences of ``seq_len`` tokens per forward, its precision, device and ranks; nothing
    trains), what it computes after the decoder (:data:`COMPUTES`) and, for generation, the new tokens."""

    stage: str
    layout: Job
    computes: tuple[str, ...]
    new_tokens: int = 0

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ForwardJob:
        """The job of one entry of ``moeflow.workflow.keys.forward_plan_settings``."""
        parallel, hardware = settings["parallel"], settings["hardware"]
        ranks = int(parallel["nproc_per_node"])
        layout = Job(
            precision=settings["precision"],
            method="full",
            micro_batch_size=int(settings["sequences"]),
            seq_len=int(settings["tokens_per_sequence"]),
            gradient_checkpointing=False,
            attn_implementation=settings["model"]["attn_implementation"],
            device=hardware["device"],
            num_devices=ranks,
            expert_parallel=parallel["strategy"] == "ep",
            lora=typed(LoraSettings, {}),  # nothing trains
            loss_chunk_tokens=int(settings["model"]["loss_chunk_tokens"]),
            ranks_per_node=ranks,
            replicated=parallel["strategy"] == "none",
            ep_size=int(parallel["ep_size"]),
        )
        return cls(settings["stage"], layout, COMPUTES[settings["stage"]], int(settings.get("new_tokens") or 0))

    def on(self, ranks: int) -> ForwardJob | None:
        """The same stage on ``ranks`` ranks in its layout's kind: ``none`` on one rank and fsdp on more for a
        ``none`` or fsdp stage; ep on a multiple of its ``ep_size`` (None on any other count)."""
        lay = self.layout
        if lay.expert_parallel and ranks % lay.ep_size:
            return None
        shared = dict(num_devices=ranks, ranks_per_node=ranks)
        if lay.expert_parallel:
            return dataclasses.replace(self, layout=dataclasses.replace(lay, **shared))
        return dataclasses.replace(self, layout=dataclasses.replace(lay, replicated=ranks == 1, **shared))


def kv_cache_elements_per_token(s: Shape) -> int:
    """Keys and values every layer caches per token: ``2 x kv heads x head_dim`` (GQA), or with MLA each
    query head's key and value (transformers caches them decompressed)."""
    if s.attention == "mla":
        per_layer = [s.heads(i) * (s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim) for i in range(s.num_layers)]
    else:
        per_layer = [2 * s.num_kv_heads * s.head_dim] * s.num_layers
    return sum(per_layer)


def forward_memory(s: Shape, params: ParamCount, job: ForwardJob) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes per rank in each of :data:`FORWARD_PHASES`: ``{phase: {"device": {term: bytes, "total": n},
    "host": {...}}}`` (module docstring)."""
    lay = job.layout
    width = WEIGHT_BYTES[lay.precision]
    sequences, tokens = lay.micro_batch_size, lay.micro_batch_size * lay.seq_len
    weights = math.ceil(params.total * width / lay.shard_ranks)
    unit = gathered_unit(params, lay) * width if lay.sharded else 0
    moe = set(s.moe_layers)
    largest_layer = max(
        layer_activation_elements(s, lay.seq_len, lay.attn_implementation == "eager", i in moe, None, s.heads(i))
        for i in range(s.num_layers)
    )
    output = {"router_scores": 0, "logits": 0, "kv_cache": 0}
    if "routing" in job.computes:
        output["router_scores"] = tokens * s.num_experts * len(s.moe_layers) * FP32_BYTES
    if "chunked" in job.computes:
        chunk = min(lay.loss_chunk_tokens, tokens)
        per_logit = LOSS_BYTES_PER_LOGIT + (width if width < FP32_BYTES else 0)
        output["logits"] = chunk * s.vocab_size * per_logit + tokens * (FP32_BYTES + 1)
    if "generate" in job.computes:
        output["logits"] = sequences * s.vocab_size * (width + FP32_BYTES)
        output["kv_cache"] = sequences * (lay.seq_len + job.new_tokens) * kv_cache_elements_per_token(s) * width
    runtime = {"runtime": runtime_bytes(lay.device)}
    device = {
        "load": {"weights": weights} | runtime,
        "forward": {
            "weights": weights,
            "unsharded_layer": unit,
            "prefetched_layer": unit,
            "root_unit": root_unit_parameters(s, params) * width if lay.sharded else 0,
            "layer_activations": tokens * (largest_layer + 2 * s.hidden_size) * width,
            "attention_masks": attention_mask_bytes(s, lay),
        }
        | output
        | runtime,
    }
    on_cuda = lay.device == "cuda"
    owned = math.ceil(params.largest_tensor * width / lay.shard_ranks)
    host = {"load": {"read_buffer": owned}, "forward": {}}
    out = {}
    for phase in FORWARD_PHASES:
        side = host[phase] | {"runtime": CUDA_HOST_RUNTIME_BYTES} if on_cuda else {}
        out[phase] = {"device": with_total(device[phase]), "host": with_total(side)}
    return out


def worst_total(s: Shape, params: ParamCount, job: ForwardJob) -> int:
    return max(phase["device"]["total"] for phase in forward_memory(s, params, job).values())


def min_ranks(s: Shape, params: ParamCount, job: ForwardJob, memory: int, limit: int = 1024) -> int | None:
    """The smallest rank count in the stage's kind of layout (:meth:`ForwardJob.on`) at which it fits with
    headroom, or None."""
    for ranks in range(1, limit + 1):
        at = job.on(ranks)
        if at is not None and verdict(worst_total(s, params, at), memory) == "fits":
            return ranks
    return None


def forward_plan(s: Shape, params: ParamCount, job: ForwardJob, memory: int) -> dict[str, Any]:
    """The stage's phases per rank with their verdicts against ``memory`` (one device's), the worst phase's
    verdict, and the smallest rank count that fits."""
    phases = forward_memory(s, params, job)
    worst = max(phases, key=lambda name: phases[name]["device"]["total"])
    result = verdict(phases[worst]["device"]["total"], memory)
    return {
        "stage": job.stage,
        "ranks": job.layout.num_devices,
        "strategy": job.layout.strategy,
        "phases": phases,
        "worst_phase": worst,
        "verdict": result,
        "device_memory_bytes": memory,
        "min_ranks": min_ranks(s, params, job, memory) if result != "fits" else job.layout.num_devices,
    }


def summary(p: Mapping[str, Any], batch: Mapping[str, Any]) -> str:
    """A stage's :func:`forward_plan` in a sentence: its ranks, layout and worst phase per rank by term."""
    section, terms = batch["section"], p["phases"][p["worst_phase"]]["device"]
    shown = ", ".join(f"{k} {gib(v)}" for k, v in terms.items() if v and k != "total")
    return (
        f"rule {p['stage']} on its {p['ranks']} rank(s) in {p['strategy']} (config keys '{section}.ranks' and "
        f"'{section}.strategy'): {gib(terms['total'])} GiB per rank in its {p['worst_phase']} phase ({shown}) of a "
        f"device's {gib(p['device_memory_bytes'])} GiB"
    )


def refusal(p: Mapping[str, Any], batch: Mapping[str, Any]) -> str:
    """Why a stage's :func:`forward_plan` does not fit, naming its section's keys, and what would fit."""
    section = batch["section"]
    sharded = f" and {section}.strategy: fsdp" if p["strategy"] == "none" and (p["min_ranks"] or 1) > 1 else ""
    fix = (
        f"it fits on {p['min_ranks']}: set {section}.ranks: {p['min_ranks']}{sharded} (and give rule {p['stage']} as "
        "many GPUs in the profile)"
        if p["min_ranks"]
        else f"no count of ranks in {p['strategy']} fits"
    )
    return f"does not fit: {summary(p, batch)}; {fix}, or a smaller '{batch['batch_key']}'"


def refuse_unless_fits(
    batch: Mapping[str, Any], model: Mapping[str, Any], folder: str | os.PathLike, layout: Any
) -> dict[str, Any] | None:
    """At a forward-only stage's start, before its model is loaded: its :func:`forward_plan` per rank against the
    memory of this rank's GPU (torch's total), refused (PlanError, :func:`refusal`) where it does not fit, a
    warning where it is tight. ``batch``: moeflow.workflow.keys.forward_batch; ``model``: the config's model
    section, counted from ``folder``; ``layout``: the stage's moeflow.loading.factory.Layout. On the CPU nothing is
    checked (None)."""
    if layout.ranks.device.type != "cuda":
        return None
    import torch

    memory = torch.cuda.get_device_properties(layout.ranks.device).total_memory
    shape, params, _ = count_parameters({**model, "pretrained": str(folder)})
    settings = dict(batch) | {
        "model": model,
        "hardware": {"device": "cuda"},
        "parallel": dataclasses.asdict(layout.parallel),
        "precision": layout.precision,
    }
    p = forward_plan(shape, params, ForwardJob.from_settings(settings), memory)
    if p["verdict"] == "does_not_fit":
        raise PlanError(refusal(p, batch))
    if p["verdict"] == "tight":
        log.warning("fits with less than 10%% headroom: %s", summary(p, batch))
    return p
