"""A final model folder with no MoE layer written as its family's dense architecture, which serving engines load.

The embedded default's dense twin is a ``qwen3_moe`` model with ``num_experts: 0``: every layer a dense SwiGLU MLP
of ``intermediate_size``, under the names Qwen3's dense model uses (``mlp.gate_proj``, ``up_proj``, ``down_proj``).
transformers loads it as Qwen3-MoE, but a serving engine refuses it (vLLM: "No Qwen3MoE layer found in the
model.layers"). Its config.json is written as the family's ``dense_model_type`` (moeflow.families.family.Family):
the dense config's own keys, taken from the MoE config, and the dense causal LM as its architecture; the weights
are the same files, and ``from_pretrained`` gives the same logits (tests/unit/test_dense_export.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moeflow.families.registry import family

# Keys of the MoE config that say nothing of the dense model or that transformers writes itself.
NOT_CARRIED = ("model_type", "architectures", "transformers_version", "auto_map")


def moe_layers(model: Any) -> int:
    """How many MoE blocks ``model`` has (its family's ``block_class``; FSDP2's ``FSDP<class>`` too)."""
    known = family(getattr(model.config, "model_type", None))
    block = known.block_class if known is not None else None
    return sum(1 for m in model.modules() if block is not None and type(m).__name__.endswith(block))


def dense_config(config: Any) -> Any:
    """The dense architecture's config for the transformers ``config`` of a model with no MoE layer: every key the
    dense config has, as the MoE config sets it, and the dense causal LM as its architecture."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    dense_type = family(config.model_type).dense_model_type
    own = AutoConfig.for_model(dense_type).to_dict()
    fields = {k: v for k, v in config.to_dict().items() if k in own and k not in NOT_CARRIED}
    dense = AutoConfig.for_model(dense_type, **fields)
    dense.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[dense_type]]
    return dense


def write_dense_architecture(folder: str | os.PathLike, model: Any) -> bool:
    """Rewrite ``folder``'s config.json (``model``'s export) as its family's dense architecture where the family
    has one and ``model`` has no MoE layer; whether it did."""
    from transformers import AutoConfig

    known = family(getattr(model.config, "model_type", None))
    if known is None or known.dense_model_type is None or moe_layers(model):
        return False
    dense_config(AutoConfig.from_pretrained(Path(folder), local_files_only=True)).save_pretrained(folder)
    return True
