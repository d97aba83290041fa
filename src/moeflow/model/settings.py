"""The ``model`` section's typed settings (moeflow.loading.factory builds and loads models from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from packaging.version import Version

from moeflow.runtime import compat
from moeflow.settings import MODEL_SCHEMA, enum, plain

# ``model.experts_implementation`` that rule choose_experts resolves by measurement; the factory applies the
# rule's choice file (moeflow.model.experts_choice).
AUTO_EXPERTS = "auto"


# An experts implementation of None: whatever the stack and the folder use by default (the choice made for a
# model without experts, and a benchmark that measures the stack's default).
STACK_DEFAULT_EXPERTS = None


@dataclass(frozen=True)
class ModelSettings:
    """``model``: the model a run builds from ``config`` or loads from ``pretrained``, and how it computes.
    Build one with ``moeflow.settings.typed``: keys left out take the schema's defaults."""

    SCHEMA: ClassVar[str] = MODEL_SCHEMA
    pretrained: str | None
    trust_remote_code: bool
    attn_implementation: str
    experts_implementation: str | None
    loss_chunk_tokens: int
    quantization: str  # none | nf4 | fp4 | int8: a LoRA run's frozen base (moeflow.model.quantization)
    config: dict[str, Any]


# model.quantization's formats (moeflow.model.quantization): bits per element, and elements per fp32 scale (a 4-bit
# block; int8 scales each row). Here, torch-free: the planner counts them at DAG build.
QUANTIZED_BITS = {"nf4": 4, "fp4": 4, "int8": 8}


QUANTIZATION_BLOCK = 64


# A quantized weight's dense rows read from the folder at a time before they are packed (at least one row:
# moeflow.parallel.rank_load), which the planner counts in the load phase.
QUANTIZED_READ_BYTES = 64 * 2**20


def quantized_bytes_per_element(kind: str, width: int = 0) -> float:
    """Bytes a weight element takes in ``kind`` with its share of the scales (``width``: the row's, for int8's one
    scale per row; 0: scales not counted)."""
    per_scale = width if kind == "int8" else QUANTIZATION_BLOCK
    return QUANTIZED_BITS[kind] / 8 + (4 / per_scale if per_scale else 0)


BITSANDBYTES_TORCH = "2.4"  # bitsandbytes 0.50's oldest torch


def quantization_problems(
    kind: str, method: str, gradient_checkpointing: bool, lora_targets: tuple[str, ...] = ()
) -> list[str]:
    """What ``model.quantization`` cannot run with, each naming the keys and what to do: a quantized base is frozen,
    so a LoRA run's; with activation checkpointing (else autograd keeps every layer's dequantized weight); on a
    torch bitsandbytes runs on; not with adapters on the routed experts alone (``lora_targets``: those go beside
    peft's, moeflow.model.quantized_experts). The config check and the planner's proposals refuse the same."""
    if kind == "none":
        return []
    problems = []
    if method == "lora" and set(lora_targets) == {"routed_experts"}:
        problems.append(
            f"config keys 'model.quantization': {kind} and 'train.lora.targets': [routed_experts] do not combine: a "
            "quantized base's experts run one at a time with their adapters beside peft's, which need a module to "
            "adapt too. Add attention to train.lora.targets"
        )
    if method != "lora":
        problems.append(
            f"config keys 'model.quantization': {kind} and 'train.method': {method} do not combine: a quantized base "
            "is frozen, and only LoRA's adapters train over it. Use train.method: lora, or model.quantization: none"
        )
    elif not gradient_checkpointing:
        problems.append(
            f"config key 'model.quantization': {kind} needs train.gradient_checkpointing: true: without it autograd "
            "keeps every layer's dequantized weight for the backward pass, a dense copy of the base"
        )
    torch_version = compat.version_of("torch")
    if torch_version is not None and torch_version.release < Version(BITSANDBYTES_TORCH).release:
        problems.append(
            f"config key 'model.quantization': {kind} runs on bitsandbytes, which needs torch {BITSANDBYTES_TORCH} "
            f"or newer, and this stack has torch {torch_version}: use STACK=current, or model.quantization: none"
        )
    return problems


LORA_ALL = "all"


@dataclass(frozen=True)
class LoraSettings:
    """``train.lora``. ``targets`` keeps what the config names; ``categories`` resolves ``all``."""

    SCHEMA: ClassVar[str] = "#/$defs/lora"
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    router: str

    @property
    def categories(self) -> tuple[str, ...]:
        """The module categories that get adapters, in the schema's order."""
        every = tuple(t for t in enum("#/$defs/lora/properties/targets") if t != LORA_ALL)
        return every if LORA_ALL in self.targets else tuple(t for t in every if t in self.targets)

    def as_dict(self) -> dict[str, Any]:
        return plain(self)


@dataclass(frozen=True)
class ExpertsLayout:
    """How training holds the experts while rule choose_experts times them: ``strategy`` (FSDP's bf16 weights)
    and ``ep_size`` (one rank's experts under ep)."""

    strategy: str
    ep_size: int


@dataclass(frozen=True)
class ExpertsChoiceStage:
    """Rule choose_experts (moeflow.workflow.keys.experts_settings; moeflow.model.experts_choice times one MoE block
    of this shape). Here, not beside the timing code: the stage claims its GPU before anything imports torch."""

    model: ModelSettings
    micro_batch_size: int
    seq_len: int
    device: str
    precision: str
    parallel: ExpertsLayout
