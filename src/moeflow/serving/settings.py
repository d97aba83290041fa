"""The serving check's typed settings, apart from its torch code: its script reads them before it claims a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeflow.model.settings import ModelSettings


@dataclass(frozen=True)
class ServeSettings:
    """The ``serve`` config section: the serving environment's Python and how closely the engine must agree."""

    SCHEMA: ClassVar[str] = "#/properties/serve"

    python: str | None
    dtype: str
    tolerance: float
    max_sequences: int | None
    timeout_s: float


@dataclass(frozen=True)
class ServeCheckStage:
    """Rule serve_check: the run, how its model loads in moeflow (``model``, ``device``) and the ``serve`` section."""

    run: str
    model: ModelSettings
    device: str
    serve: ServeSettings


@dataclass(frozen=True)
class ServingAdapterStage:
    """Rule serving_adapter: the LoRA run whose adapter it rewrites."""

    run: str
