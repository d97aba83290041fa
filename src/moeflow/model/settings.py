"""The ``model`` section's typed settings (moeflow.loading.factory builds and loads models from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
    config: dict[str, Any]


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
