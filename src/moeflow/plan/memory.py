"""The memory planner's per-rank memory in every phase of a training job.

The parameters it counts are moeflow.plan.counts' (from a model config, no weights: the meta device or the closed
form), in moeflow.plan.shapes' shape of the model.

Memory per device in a training step (bytes, :func:`memory_per_device`, the ``step`` phase), for a job of
``micro_batch_size`` sequences of ``seq_len`` tokens; the terms are summed, a conservative peak (the loss's
buffers and the gathered layers of the backward pass are not all live at the same instant):
    * weights: parameters x 2 (bf16) or 4 (fp32);
    * gradients: trainable parameters x the same width (a full fine-tune trains all but the MTP layers, and
      those too with ``train.mtp.mode: train``);
    * optimizer (AdamW): trainable parameters x 8 (two fp32 moments), + 4 for an fp32 master copy with bf16
      (``train.optimizer: muon``: the hidden matrices keep one fp32 momentum buffer, 4, :func:`optimizer_state_bytes`;
      sharded, plus one parameter gathered whole for its update, :func:`muon_gathered_bytes`);
      either way 16 bytes per trainable parameter, the same total as moeflow.train.trainer's bf16 autocast
      (fp32 weights 4 + fp32 gradients 4 + moments 8) and as FSDP mixed precision (fp32 sharded master
      weights 4 + fp32 sharded gradients 4 + moments 8);
    * with ``parallel.strategy`` fsdp or ep (``Job.shard_ranks > 1``: ``parallel.fsdp_size``, all ranks by
      default; a config without ranks but several ``hardware.num_devices`` is planned as FSDP over them)
      these three are sharded over the ranks (FSDP full sharding, bf16 as FSDP
      mixed precision: bf16 parameters gathered and computed with, fp32 masters, fp32 gradient reduction),
      and each device also holds, in the gathered width (2 for bf16, 4 for fp32):
        - unsharded_layer: the largest decoder layer (one FSDP unit) while it runs, its weights and its
          unsharded gradient; with expert parallelism (``Job.expert_parallel``, experts split over
          ``parallel.ep_size`` ranks) a rank runs its ``1 / ep_size`` of the experts, gathered over the
          ``shard_ranks / ep_size`` ranks that share them (none when that is one), with the rest of the layer
          (:func:`gathered_unit`); MTP layers never run, so they are never gathered;
        - prefetched_layer: the next unit's weights, all-gathered while this one runs;
        - layer_gradient_reduce: the unit's gradient copied into the fp32 reduce-scatter buffer;
        - root_unit: the root unit (embedding, LM head, final norm), gathered for the whole step (the
          root is not resharded after the forward pass), and its gradient, held until the end of backward;
    * residual_stream: the layer inputs kept for the backward pass, ``T x layers x H`` with gradient
      checkpointing (``2 x`` without: the input and the residual after attention), with ``T =
      micro_batch_size x seq_len`` tokens, in fp32 where the weights are fp32 (fp32, and bf16 autocast on
      one device), in bf16 under FSDP mixed precision;
    * activations, per device (each device runs its own micro-batch), in the compute width ``a`` (2 for
      bf16, 4 for fp32):
        - per layer and token, the tensors kept for the backward pass: attention ``2H + (q + 2kv) d +
          q d + q`` (layer input, norm output, q/k/v, attention output, softmax statistics; plus the
          head gates where the model has them), plus ``q x seq_len`` attention probabilities with eager
          attention; ``2H`` for the FFN's norm input and output; then a dense FFN ``3 I``, or an MoE FFN
          ``2E + k (2H + 3 I_e) + 3 I_s + H`` (router scores, each token's copy into and out of its
          k experts with their gate/up/activation, the shared expert); MLA (deepseek_v3) uses its
          latent and per-head widths for q/k/v;
        - without checkpointing: ``T x a x sum over layers``; with gradient checkpointing: ``T x a x the
          largest layer`` (one layer recomputed at a time); less the layer inputs the residual stream
          counts, plus the final norm;
    * attention_masks: with sdpa or eager attention, the ``micro_batch_size x L x L`` mask of each attention type
      (full, sliding window; booleans or additive floats), built once per forward and held for the step
      (:func:`attention_mask_bytes`); none with flash-attn;
    * loss: moeflow.model.chunked_loss applies the output layer to ``C = min(model.loss_chunk_tokens, T)`` tokens
      at a time: ``C x vocab x (4 + 2 with bf16)`` (a chunk's fp32 logits, turned into their gradient in
      place, and with bf16 the product before its fp32 copy and the gradient's bf16 copy), plus what it
      keeps from the forward to the backward pass, in fp32: the hidden states' gradient ``T x H x 4``, the
      output weight's gradient ``vocab x H x 4`` when the output layer trains (not with LoRA), and the
      per-token losses ``T x 4``;
    * runtime: a fixed overhead (the CUDA context with NCCL's and cuBLAS's buffers; on CPU the measured
      resident set of a training rank beside its model: ``CPU_RANK_RUNTIME_BYTES``, with peft's for LoRA).
    ``parallel.strategy: none`` on several ranks (``Job.replicated``): every rank holds all of it, unsharded.

The phases (:func:`phase_memory`, per rank; the resident state is the parameters in fp32, ``PARAM_BYTES``,
frozen ones included, and AdamW's two fp32 moments of the trained ones, both over ``Job.shard_ranks``):
    * load: the rank's share of the weights, allocated empty and filled with the rows it owns from the
      folder's safetensors (moeflow.parallel.rank_load; ``none`` and one rank load the whole model), plus on the
      pinned stack (FSDP1) the largest unit materialised whole while it is wrapped, plus on CUDA one
      tensor's owned rows read into a host buffer;
    * step: :func:`memory_per_device`;
    * checkpoint: the resident state (the gradients are freed after each step; each rank writes its own
      shards, moeflow.checkpoint.state), plus on CUDA one tensor's shard staged on the host;
    * resume: the resident state (the model, then AdamW's shards read into) and the zero gradients of the
      step torch.distributed.checkpoint initialises a fresh optimizer's state with, plus on CUDA one
      tensor's read buffer;
    * export: the resident state and one whole parameter gathered on every rank (the largest:
      ``ParamCount.largest_tensor``, the embedding, or a layer's fused experts on transformers 5), staged on
      the host on CUDA; rank 0 streams each tensor to its file (no buffer of ``export.max_shard_size``).
    Each side (device, host) of a phase has its terms and a ``total``. On CUDA the host side also holds the
    host runtime per rank (``CUDA_HOST_RUNTIME_BYTES``: interpreter, torch, CUDA's host libraries); with
    ``hardware.device: cpu`` there is one memory: every term is on the device side, the runtime once,
    nothing is staged, and :func:`rank_bytes` (device + host) is what the rank's peak RSS should be, less its
    file-backed pages (moeflow.train.peak_memory).

``parallel.cpu_offload`` (``Job.cpu_offload``: FSDP2's offload policy, also over one rank): on CUDA the sharded state
(weights, gradients, optimizer; :func:`step_state`) is on the host side of the step, and the resident state, the
zero gradients, the gathered and merged tensors of every other phase too, leaving the device its runtime there; the
step's device keeps the gathered units and, per unit, its shards copied in and its gradient's copied out
(``offload_copies``). On the CPU the two sides are one memory.

Whether the phases fit, on which devices, and what would make them fit: moeflow.plan.fit.

``train.method: lora`` (settings ``train.lora``, see moeflow.model.lora): the base weights are frozen (weights
only, no gradients or optimizer states), held in bf16 with ``precision: bf16`` in every phase (no fp32 copy;
moeflow.loading.factory.Layout.weights_dtype); the adapters are held in fp32 with fp32 gradients and AdamW's two
moments (16 bytes per parameter, no master copy), and so are the routers' weights with ``router: trainable``.
Adapter parameters are counted from the config:
``rank x (in + out)`` for every adapted matrix (:func:`lora_matrices`), i.e. per layer q/k/v/o (plus
step3p5's head gate; MLA: its down/up projections), the dense or shared SwiGLU's gate/up/down, a router
adapter ``rank x (hidden + experts)``, and per routed expert gate/up/down on transformers 4.57 (separate
linear layers) or its fused gate_up ``rank x (hidden + 2 I_e)`` and down projection on transformers 5
(``target_parameters``; GPT-OSS fuses on both), so the same config plans slightly differently per stack.
Activations add, per adapted matrix a token passes through (k of the routed experts), the rank-r
intermediate and, with dropout, a copy of the matrix's input; adapted fused experts over a base in the compute dtype
add peft's dense fold of them (:func:`folded_experts_bytes`). With ``model.quantization`` the decoder matrices are
held in 4 or 8 bits with their scales (gathered so under FSDP), and a layer's are dense while it runs, its fused
experts one at a time (``dequantized_layer``). A full fine-tune is offered LoRA and QLoRA among
moeflow.plan.proposals' configurations.

``train.method: esft`` (moeflow.train.expert_mask): gradients and AdamW's state for the selected experts only where each
expert is its own module (transformers 4.57; ``Job.esft_selected`` pairs, all of them while no selection is
known), for every MoE layer's whole fused expert tensors where they are fused (transformers 5: the unselected rows
carry zero moments), plus the shared experts and non-expert parameters where configured
(moeflow.plan.counts.esft_trainable). Under FSDP1, gradients for whole decoder layers (:func:`gradient_parameters`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeflow.families import registry
from moeflow.model.settings import QUANTIZED_READ_BYTES, LoraSettings, quantized_bytes_per_element
from moeflow.plan.activations import (
    FP32_BYTES,
    WEIGHT_BYTES,
    activation_bytes,
    attention_mask_bytes,
    loss_bytes,
    residual_stream_bytes,
)
from moeflow.plan.counts import ParamCount, esft_trainable, lora_count, quantized_parameters
from moeflow.plan.shapes import PlanError, Shape
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.settings import EsftSettings

GIB = 2**30


ADAM_MOMENT_BYTES = 8  # two fp32 moments


MUON_BUFFER_BYTES = 4  # Muon's one fp32 momentum buffer


MASTER_WEIGHT_BYTES = {"fp32": 0, "bf16": 4}  # an fp32 master copy when the weights are bf16


# What a rank holds beside its model: the CUDA context (with NCCL's and cuBLAS's buffers) on CUDA; on CPU a
# training rank's own resident memory, by transformers major version (the stack): its interpreter, torch,
# transformers, moeflow, the data's libraries, gloo, and what its first step leaves allocated, without the
# file-backed pages (shared libraries' code: clean, and as large as the page cache makes them,
# moeflow.train.peak_memory). Measured as the smoke pipeline's phase peaks (a model of a few MiB) less the plan's
# model terms, benchmarks/rank_runtime.py (docs/memory-plan.md): 360 MiB in a step on the pinned stack (torch
# 2.3.1+cu121, transformers 4.57.1), 335 MiB on the current one (torch 2.13 CPU, 5.24); the load about 10 MiB less.
CPU_RANK_RUNTIME_BYTES = {4: 360 * 2**20, 5: 335 * 2**20}

# A LoRA rank's imports beside those: peft, and on the current stack the bitsandbytes it imports (measured as above).
CPU_ADAPTER_RUNTIME_BYTES = {4: 15 * 2**20, 5: 55 * 2**20}


CUDA_RUNTIME_BYTES = 1 * GIB


# The parameters moeflow holds are fp32 in every layout (loaded in fp32; bf16 is autocast on one device and
# FSDP mixed precision's gathers): the width of the resident state in the load, checkpoint, resume and export phases.
# LoRA under bf16 is the exception: its frozen base is held in bf16 (:func:`held_weight_bytes`).
PARAM_BYTES = 4


CUDA_HOST_RUNTIME_BYTES = 3 * GIB  # per rank on a GPU node: interpreter, torch, CUDA's host libraries


PHASES = ("load", "step", "checkpoint", "resume", "export")


@dataclass(frozen=True)
class PlanMemoryStage:
    """Rule plan_memory (moeflow.workflow.keys.plan_settings): the run's config sections the plan depends on, the
    model's and the tokenizer's vocabulary."""

    model: Mapping[str, Any]
    vocab_size: int
    hardware: Mapping[str, Any]
    parallel: Mapping[str, Any]
    train: Mapping[str, Any]
    seq_len: int
    precision: str


@dataclass(frozen=True)
class Job:
    """The training settings memory depends on, per rank.

    :meth:`from_settings` reads them from a :class:`PlanMemoryStage`. A job outside a config (a
    benchmark's worker) is constructed with every field, e.g. ``fsdp`` over 2 gloo ranks of one node in fp32::

        shape, params, _ = plan.count_parameters(model_cfg, vocab_size)  # model_cfg: the run's model section
        job = plan.Job(precision="fp32", method="full", micro_batch_size=1, seq_len=256,
                       gradient_checkpointing=False, attn_implementation="sdpa", device="cpu", num_devices=2,
                       expert_parallel=False, lora=config.settings(config.LoraSettings, {}),
                       loss_chunk_tokens=1024, ranks_per_node=2, replicated=False, fsdp_size=None)
        phases = plan.phase_memory(shape, params, job)  # phases["load"]["device"]["total"], ...

    ``num_devices`` is the world size; ``replicated=True`` is ``parallel.strategy: none`` (every rank holds the
    whole model), ``expert_parallel=True`` is ``strategy: ep``, neither is ``fsdp``; ``model.loss_chunk_tokens``
    and ``model.attn_implementation`` as the model section has them (the schema's defaults: 1024, sdpa).
    """

    precision: str
    method: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    attn_implementation: str
    device: str
    num_devices: int
    expert_parallel: bool  # experts split over the devices (transformers 5's DistributedConfig)
    lora: LoraSettings  # train.lora: used when method is lora (and for the LoRA suggestion)
    loss_chunk_tokens: int  # model.loss_chunk_tokens: the cross-entropy's tokens per chunk
    ranks_per_node: int  # the ranks of one host (host memory per node = ranks_per_node x per rank)
    replicated: bool = False  # parallel.strategy: none on several ranks: every rank holds the whole model
    fsdp_size: int | None = None  # parallel.fsdp_size: the ranks that shard the states (None: all of them)
    ep_size: int = 1  # parallel.ep_size: the ranks one layer's experts are split over (1 with expert_parallel: all)
    optimizer: str = "adamw"  # train.optimizer: muon keeps one buffer for the hidden matrices (optimizer_state_bytes)
    esft: EsftSettings | None = None  # train.esft: used when method is esft
    esft_selected: int | None = None  # (layer, expert) pairs ESFT selected; None: not yet known, plan for all
    mtp_trained: bool = False  # train.mtp.mode: train (a full fine-tune): the MTP layers train too
    quantization: str = "none"  # model.quantization: a LoRA run's frozen decoder matrices in 4 or 8 bits
    cpu_offload: bool = False  # parallel.cpu_offload: FSDP2 with the sharded state on the host

    @classmethod
    def from_settings(cls, settings: PlanMemoryStage) -> Job:
        """The job of the plan's settings in its ``parallel`` section's layout. A config that names no ranks
        (``parallel`` of one process) but several ``hardware.num_devices`` is a plan on paper: FSDP over that many
        devices of one node."""
        train, hardware, parallel = settings.train, settings.hardware, settings.parallel
        if train["optimizer"] not in ("adamw", "muon"):
            raise PlanError(
                f"config key 'train.optimizer': the planner knows adamw and muon, got {train['optimizer']!r}"
            )
        on_paper = parallel["nproc_per_node"] * parallel["nnodes"] == 1
        return cls(
            precision=settings.precision,
            method=train["method"],
            micro_batch_size=int(train["micro_batch_size"]),
            seq_len=settings.seq_len,
            gradient_checkpointing=bool(train["gradient_checkpointing"]),
            attn_implementation=settings.model["attn_implementation"],
            device=hardware["device"],
            num_devices=int(hardware["num_devices"]),
            expert_parallel=parallel["strategy"] == "ep",
            # a full run's settings carry no train.lora: the LoRA suggestion uses the defaults
            lora=typed(LoraSettings, train["lora"] or {}),
            loss_chunk_tokens=int(settings.model["loss_chunk_tokens"]),
            ranks_per_node=int(hardware["num_devices"] if on_paper else parallel["nproc_per_node"]),
            replicated=parallel["strategy"] == "none" and not on_paper,
            fsdp_size=parallel["fsdp_size"],
            ep_size=int(parallel["ep_size"]),
            optimizer=train["optimizer"],
            esft=typed(EsftSettings, train["esft"]) if train.get("esft") else None,
            mtp_trained=(train.get("mtp") or {}).get("mode") == "train",
            quantization=settings.model["quantization"],
            cpu_offload=bool(parallel.get("cpu_offload", False)),
        )

    @property
    def strategy(self) -> str:
        """The layout as ``parallel.strategy`` names it."""
        if self.expert_parallel:
            return "ep"
        if self.cpu_offload:
            return "fsdp"
        return "none" if self.replicated or self.num_devices == 1 else "fsdp"

    @property
    def shard_ranks(self) -> int:
        """The ranks the weights, gradients and AdamW states are split over (1: every rank holds them whole)."""
        return 1 if self.strategy == "none" else (self.fsdp_size or self.num_devices)

    @property
    def expert_ranks(self) -> int:
        """The ranks one layer's routed experts are split over under expert parallelism (``ep_size``; every
        sharding rank when the job names none, as a suggestion does)."""
        return self.ep_size if self.ep_size > 1 else self.shard_ranks

    @property
    def sharded(self) -> bool:
        """FSDP over the devices: one decoder layer (and the root unit) gathered at a time; so too under CPU
        offload on one device (FSDP2 over a group of one)."""
        return self.shard_ranks > 1 or self.cpu_offload

    @property
    def offloads_to_host(self) -> bool:
        """The sharded state held in the host's memory, not the device's (``cpu_offload`` on CUDA; on the CPU the
        two are one memory)."""
        return self.cpu_offload and self.device == "cuda"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"strategy": self.strategy, "shard_ranks": self.shard_ranks}

    @property
    def mixed_precision(self) -> bool:
        """FSDP mixed precision (moeflow.parallel.layouts with precision bf16): bf16 parameters gathered and
        computed with, fp32 sharded master weights and an fp32 gradient reduce-scatter. On one device bf16
        is autocast over fp32 weights."""
        return self.sharded and self.precision == "bf16"


def root_unit_parameters(s: Shape, params: ParamCount) -> int:
    """The FSDP root unit: what no decoder layer holds (the embedding, the LM head, the final norm)."""
    return params.embeddings + s.hidden_size


def gradient_parameters(s: Shape, params: ParamCount, job: Job, trainable: int) -> int:
    """The parameters that hold a gradient: the trained ones, except ESFT under FSDP1 (the pinned stack), where a
    unit's flat parameter has a gradient for all of its parameters once any of them trains: every decoder layer's
    (each MoE layer keeps an expert), the root unit's only with ``train.esft.train_non_expert``."""
    if job.method != "esft" or not job.sharded or job.expert_parallel or compat.fsdp2_available():
        return trainable
    layers = params.without_mtp - root_unit_parameters(s, params)
    return max(trainable, layers + (root_unit_parameters(s, params) if job.esft.train_non_expert else 0))


def memory_per_device(s: Shape, params: ParamCount, job: Job) -> dict[str, int]:
    """Bytes per device by component (module docstring); ``total`` is their sum. Under CPU offload on CUDA the
    sharded state (:func:`step_state`) is the host's, not a device term."""
    width = WEIGHT_BYTES[job.precision]
    unit = gathered_unit(params, job)
    root = root_unit_parameters(s, params)
    if job.method == "lora":  # frozen base: weights only; adapters (and a trainable router) get everything
        unit_added, unit_trainable = lora_count(s, job.lora).largest_layer(job.expert_parallel)
        root_trainable = 0  # no adapters on the embedding or the LM head
        gradient_width = FP32_BYTES  # the adapters (and a trainable router) train in fp32
    else:
        unit_added, unit_trainable, root_trainable, gradient_width = 0, unit, root, width
    gathered = unit + unit_added
    # a quantized base's unit is gathered as stored: its decoder matrices (most of a layer) in 4 or 8 bits
    stored = (
        quantized_bytes_per_element(job.quantization, s.hidden_size)
        if quantized_parameters(params, job.quantization)
        else width
    )
    out = {} if job.offloads_to_host else step_state(s, params, job)
    if job.offloads_to_host:  # FSDP2 copies a unit's shards to the device for its gather, its gradient's to the host
        out["offload_copies"] = math.ceil((gathered * stored + unit_trainable * gradient_width) / job.shard_ranks)
    out |= {
        "unsharded_layer": math.ceil(gathered * stored + unit_trainable * width) if job.sharded else 0,
        "prefetched_layer": math.ceil(gathered * stored) if job.sharded else 0,
        "layer_gradient_reduce": unit_trainable * FP32_BYTES if job.sharded else 0,
        "root_unit": (root + root_trainable) * width if job.sharded else 0,
        "residual_stream": residual_stream_bytes(s, job),
        "activations": activation_bytes(s, job),
        "attention_masks": attention_mask_bytes(s, job),
        "loss": loss_bytes(s, job),
        "runtime": runtime_bytes(job.device, job.method),
    }
    if quantized_parameters(params, job.quantization):
        out["dequantized_layer"] = dequantized_layer(s, params) * width
    elif job.method == "lora":
        out["folded_experts"] = folded_experts_bytes(s, params, job)
    out["total"] = sum(out.values())
    return out


def folded_experts_bytes(s: Shape, params: ParamCount, job: Job) -> int:
    """LoRA on fused experts over a base in the compute dtype: peft's ``target_parameters`` (and under ``ep``
    moeflow.model.expert_lora) fold ``W + B A`` into a dense copy of a layer's expert tensors at each forward, which
    autograd keeps for the backward pass: every MoE layer's without gradient checkpointing, the recomputed one's with
    it; and the backward pass builds the folded tensor's gradient, as large, for the factors' gradients: one more
    layer's. Under expert parallelism a rank's own experts. None over a quantized base (one expert at a time,
    moeflow.model.quantized_experts) or where each expert is its own module (peft's ``nn.Linear`` adapters)."""
    adapters = lora_count(s, job.lora)
    if not adapters.fused_experts or not adapters.by_category["routed_experts"]:
        return 0
    layer = math.ceil(params.largest_layer_routed / (job.expert_ranks if job.expert_parallel else 1))
    held = (1 if job.gradient_checkpointing else len(s.moe_layers)) + 1  # the copies kept, and one's gradient
    return layer * held * WEIGHT_BYTES[job.precision]


def dequantized_layer(s: Shape, params: ParamCount) -> int:
    """Elements of a quantized base (moeflow.model.quantization) dense at once while a layer runs. Its matrices are
    read dense and the backward keeps them, but fused experts are read one at a time and not kept
    (moeflow.model.quantized_experts): beside the rest of the layer, an expert's largest matrix. Experts held as
    modules are each read whole, as the rest is, and peft folds the largest tensor's update into a copy of it."""
    if s.moe_layers and registry.experts_fused(s.model_type):
        return params.largest_layer_without_routed + 2 * s.expert_ffn * s.hidden_size
    return params.largest_layer + params.largest_tensor


def step_state(s: Shape, params: ParamCount, job: Job) -> dict[str, int]:
    """A rank's share of the weights, the gradients and the optimizer's state in a step (module docstring)."""
    width = WEIGHT_BYTES[job.precision]
    if job.method == "lora":  # held as trained: the adapters (and a trainable router) in fp32, no master copy
        trainable = lora_count(s, job.lora).trainable
        weights, gradient_width, master = held_weight_bytes(s, params, job), FP32_BYTES, 0
    else:
        trainable = trained_parameters(s, params, job)[1]
        weights, gradient_width, master = params.total * width, width, MASTER_WEIGHT_BYTES[job.precision]
    shards = job.shard_ranks
    return {
        "weights": math.ceil(weights / shards),
        "gradients": math.ceil(gradient_parameters(s, params, job, trainable) * gradient_width / shards),
        "optimizer": math.ceil((optimizer_state_bytes(params, trainable, job) + trainable * master) / shards)
        + muon_gathered_bytes(params, job),
    }


def gathered_unit(params: ParamCount, job: Job) -> int:
    """The parameters of the largest FSDP unit, gathered whole while its layer runs (and its full gradient held
    until the reduce-scatter). Under expert parallelism a rank runs only its own ``1 / ep_size`` of a layer's
    experts, which transformers shards over the ``shard_ranks / ep_size`` ranks that hold the same experts
    (its ``efsdp`` groups) and gathers over those: none when each rank holds its experts alone."""
    if not job.expert_parallel:
        return params.largest_layer
    if job.shard_ranks <= job.expert_ranks:
        return params.largest_layer_without_routed
    experts = math.ceil(params.largest_layer_routed / job.expert_ranks)
    return max(params.largest_layer_without_routed, params.moe_layer_without_routed + experts)


def runtime_bytes(device: str, method: str = "full") -> int:
    """A rank's fixed overhead: the CUDA context, or on CPU the measured resident set of a training rank on this
    stack (``CPU_RANK_RUNTIME_BYTES``), with peft's for a LoRA rank (``CPU_ADAPTER_RUNTIME_BYTES``)."""
    if device == "cuda":
        return CUDA_RUNTIME_BYTES
    major = compat.transformers_major()
    return CPU_RANK_RUNTIME_BYTES[major] + (CPU_ADAPTER_RUNTIME_BYTES[major] if method == "lora" else 0)


def trained_parameters(s: Shape, params: ParamCount, job: Job) -> tuple[int, int]:
    """(parameters added to the model, parameters trained): LoRA's adapters and what they train, ESFT's
    (moeflow.plan.counts.esft_trainable), else (0, all but the MTP layers, or all with ``train.mtp.mode: train``)."""
    if job.method == "esft":
        return 0, esft_trainable(s, params, job.esft, job.esft_selected)
    if job.method != "lora":
        return 0, params.total if job.mtp_trained else params.without_mtp
    adapters = lora_count(s, job.lora)
    return adapters.added, adapters.trainable


def optimizer_state_bytes(params: ParamCount, trained: int, job: Job) -> int:
    """The optimizer's state of ``trained`` parameters, whole: AdamW's two fp32 moments each, or with
    ``train.optimizer: muon`` (a full fine-tune) one fp32 momentum buffer for each hidden matrix's element
    (``ParamCount.hidden_matrices``) and AdamW's moments for the rest. AdamW's 0-d step counters are left out."""
    if job.optimizer != "muon" or job.method == "lora":
        return trained * ADAM_MOMENT_BYTES
    return params.hidden_matrices * MUON_BUFFER_BYTES + (trained - params.hidden_matrices) * ADAM_MOMENT_BYTES


def muon_gathered_bytes(params: ParamCount, job: Job) -> int:
    """Muon in a sharded layout (moeflow.train.optimizers.gathered_step): one parameter's weight, gradient and
    momentum buffer gathered whole in fp32 for its update (the largest tensor counted: a conservative bound, since
    fused experts split by experts are updated where they lie and never gathered)."""
    if job.optimizer != "muon" or job.method == "lora" or not job.sharded:
        return 0
    return 3 * params.largest_tensor * FP32_BYTES


def held_weight_bytes(s: Shape, params: ParamCount, job: Job) -> int:
    """The weights the ranks hold together, as they are held (moeflow.loading.factory.Layout.weights_dtype): every
    parameter in fp32, except LoRA under bf16, whose frozen base is held in bf16 while the adapters and a trainable
    router stay fp32."""
    if job.method == "lora":
        adapters = lora_count(s, job.lora)
        quantized = quantized_parameters(params, job.quantization)
        frozen = params.total - adapters.router_weights - quantized
        base = frozen * WEIGHT_BYTES[job.precision]
        if quantized:
            base += math.ceil(quantized * quantized_bytes_per_element(job.quantization, s.hidden_size))
        return base + adapters.trainable * PARAM_BYTES
    added, _ = trained_parameters(s, params, job)
    return (params.total + added) * PARAM_BYTES


def largest_held_tensor_bytes(params: ParamCount, job: Job) -> int:
    """The largest tensor as it is held (a frozen one in bf16 under LoRA with bf16)."""
    width = WEIGHT_BYTES["bf16"] if job.method == "lora" and job.precision == "bf16" else PARAM_BYTES
    return params.largest_tensor * width


def resident_state(s: Shape, params: ParamCount, job: Job) -> dict[str, int]:
    """What a rank keeps between steps: its share of the parameters (:func:`held_weight_bytes`, frozen ones
    included) and of the optimizer's state of the trained ones (:func:`optimizer_state_bytes`). The gradients are
    freed after each step."""
    _, trained = trained_parameters(s, params, job)
    return {
        "weights": math.ceil(held_weight_bytes(s, params, job) / job.shard_ranks),
        "optimizer": math.ceil(optimizer_state_bytes(params, trained, job) / job.shard_ranks),
    }


def wrapping_unit_bytes(s: Shape, params: ParamCount, job: Job) -> int:
    """FSDP1 materialises each unit whole (fp32) while it wraps it, before keeping this rank's shard: the
    largest unit (a decoder layer, or the root unit). FSDP2 and transformers 5's expert parallelism
    allocate the shards only."""
    if not job.sharded or job.expert_parallel or compat.fsdp2_available():  # FSDP1 on the pinned stack
        return 0
    return max(params.largest_layer, root_unit_parameters(s, params)) * PARAM_BYTES


def phase_memory(s: Shape, params: ParamCount, job: Job) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes per rank in each phase (``PHASES``): ``{phase: {"device": {term: bytes, "total": n}, "host":
    {term: bytes, "total": n}}}``, for the job's layout (``Job.strategy``; the module docstring says what each
    phase holds).

    * load: the rank's share of the weights (read from the safetensors rows it owns), FSDP1's unit while it
      wraps (pinned stack), one tensor's owned rows read into a host buffer on CUDA; with a quantized base, the
      dense rows read at a time before they are packed (:func:`quantized_read_bytes`);
    * step: :func:`memory_per_device`;
    * checkpoint: the resident state (:func:`resident_state`) and, on CUDA, one tensor's shard staged on the host;
    * resume: the resident state (the loaded weights, the optimizer's shards read into), the zero gradients of
      the step that initialises a fresh optimizer's state (``moeflow.checkpoint.pieces.state_pieces``), one
      tensor's read buffer;
    * export: the resident state and one whole parameter gathered (all ranks take part), staged on the host on CUDA;
      rank 0 streams each tensor to its shard file (no buffer of ``export.max_shard_size``); LoRA's merged weight
      is a second such tensor (moeflow.checkpoint.export.merged).

    On CUDA the host side holds the staging buffers and the host runtime (``CUDA_HOST_RUNTIME_BYTES``).
    With ``hardware.device: cpu`` there is one memory: everything is on the device side (the runtime once,
    the measured resident set of a rank), the host side is empty, and a rank's figure is
    :func:`rank_bytes` (device + host: what its peak RSS less its file-backed pages should be)."""
    state = resident_state(s, params, job)
    # a fresh optimizer's state is initialised by a step on zero gradients (torch.distributed.checkpoint's
    # private step, moeflow.checkpoint.pieces.init_optimizer_state) before the checkpoint's moments are read into it
    _, trained = trained_parameters(s, params, job)
    zero_gradients = math.ceil(trained * PARAM_BYTES / job.shard_ranks)
    whole = largest_held_tensor_bytes(params, job)
    owned = math.ceil(whole / job.shard_ranks)
    runtime = {"runtime": runtime_bytes(job.device, job.method)}
    on_cuda = job.device == "cuda"
    # LoRA's export writes each adapted weight merged, into a tensor of its own beside the gathered one
    merged = {"merged_copy": whole} if job.method == "lora" else {}
    step = {k: v for k, v in memory_per_device(s, params, job).items() if k != "total"}
    # a quantized base's rows are read dense a few at a time and packed where they land (moeflow.parallel.rank_load)
    quantized_read = (
        {"quantized_read": quantized_read_bytes(s, params, job)}
        if quantized_parameters(params, job.quantization)
        else {}
    )
    # phase: (device terms, host copies of device memory: only on CUDA)
    terms = {
        "load": (
            {"weights": state["weights"], "wrapping_unit": wrapping_unit_bytes(s, params, job)} | quantized_read,
            {"read_buffer": owned},
        ),
        "step": (step, {}),
        "checkpoint": (state, {"staging_copy": owned}),
        "resume": (state | {"initial_gradients": zero_gradients}, {"read_buffer": owned}),
        "export": (state | {"gathered_tensor": whole} | ({} if on_cuda else merged), {"staging_copy": whole} | merged),
    }
    if job.offloads_to_host:  # the state lives on the host: outside the step only the runtime is on the device
        terms = {
            phase: (device, copies) if phase == "step" else ({}, device | copies)
            for phase, (device, copies) in terms.items()
        }
        terms["step"] = (step, step_state(s, params, job))
    out = {}
    for phase, (device, copies) in terms.items():
        device = device if phase == "step" else device | runtime
        host = copies | {"runtime": CUDA_HOST_RUNTIME_BYTES} if on_cuda else {}
        out[phase] = {"device": with_total(device), "host": with_total(host)}
    return out


def quantized_read_bytes(s: Shape, params: ParamCount, job: Job) -> int:
    """A quantized base's load buffer: its dense rows read at a time and their packed bytes. At most
    ``QUANTIZED_READ_BYTES`` of rows, and never more than a rank holds of one tensor (bounded by a layer's share: a
    small model's tensors are read whole in far less)."""
    width = WEIGHT_BYTES[job.precision]
    packed = quantized_bytes_per_element(job.quantization, s.hidden_size) / width
    dense = min(QUANTIZED_READ_BYTES, math.ceil(params.largest_layer * width / job.shard_ranks))
    return math.ceil(dense * (1 + packed))


def with_total(terms: Mapping[str, int]) -> dict[str, int]:
    """``terms`` with their sum under ``total`` (a phase side of :func:`phase_memory` and of moeflow.plan.forward)."""
    return dict(terms) | {"total": sum(terms.values())}


def rank_bytes(phase: Mapping[str, Mapping[str, int]]) -> int:
    """One rank's memory in a phase of :func:`phase_memory`: device + host (on CPU, its resident set)."""
    return phase["device"]["total"] + phase["host"]["total"]


def host_per_node_bytes(phase: Mapping[str, Mapping[str, int]], job: Job) -> int:
    """A node's host memory in a phase: ``ranks_per_node`` x a rank's host side (on CPU, its whole figure)."""
    per_rank = rank_bytes(phase) if job.device == "cpu" else phase["host"]["total"]
    return job.ranks_per_node * per_rank


def worst_device_total(s: Shape, params: ParamCount, job: Job) -> int:
    """The largest per-rank device total over the phases: what must fit on one device."""
    return max(phase["device"]["total"] for phase in phase_memory(s, params, job).values())
