"""The serving stages' typed settings, and the families the engine's CPU build cannot run.

Apart from the torch code: a script reads them before it claims a GPU, and the config check without importing torch.
"""

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


# Families whose published files keep the routed experts fused (one 3-D tensor per layer): their adapters have no
# per-expert layout, and rule serving_adapter writes none (vLLM reads such adapters in its 3-D format, which moeflow
# does not write yet).
FUSED_IN_FILES = ("gpt_oss", "granitemoe")

# Families vLLM's CPU build cannot run as published, and why; on a GPU it runs them.
CPU_UNSUPPORTED = {
    "deepseek_v3": "vLLM's CPU MLA kernels take bf16 weights only and lose rotary positions (the output equals every "
    "position at 0); the check runs on a GPU",
    "gpt_oss": "vLLM's CPU build has no unquantized MoE backend for it ('No Unquantized MoE backend supports the "
    "deployment configuration'); the check runs on a GPU",
    "step3p5": "vLLM 0.32's Step-3.5 model reads num_attention_heads as one value, which transformers 5.19's per-layer "
    "config refuses (AmbiguousGlobalPerLayerAttributeError)",
}


def unsupported_reason(model_type: str, engine_device: str) -> str | None:
    """Why the engine cannot check a model of ``model_type`` on ``engine_device`` (None: it can)."""
    return CPU_UNSUPPORTED.get(model_type) if engine_device == "cpu" else None
