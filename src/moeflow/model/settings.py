"""The ``model`` section's typed settings (moeflow.model.factory builds and loads models from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moeflow.settings import MODEL_SCHEMA

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
