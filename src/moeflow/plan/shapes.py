"""A model's shape from its config: the layer, attention, expert and vocabulary sizes the planner counts with.

Each family's reader (its record's ``shape``, moeflow.families) takes ``model.config`` (or a folder's
config.json) into these sizes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeflow.families.config_fields import ConfigFieldError, mask_kinds
from moeflow.families.registry import DENSE_OF, FAMILIES, PLANNED
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed


class PlanError(ValueError):
    """A model config the planner cannot read, or a job that does not fit (with the numbers)."""


@dataclass(frozen=True)
class Shape:
    """What the parameter count and the activation estimate need from a decoder-only MoE config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    num_heads: int  # query heads of every layer, except where ``layer_heads`` says otherwise
    num_kv_heads: int
    head_dim: int
    dense_ffn: int  # FFN width of the dense layers
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # width of the always-active shared expert(s); 0 when there is none
    shared_gate: bool = False  # qwen2_moe: a sigmoid gate (H -> 1) on the shared expert
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim; "full": over all heads (olmoe)
    head_gate: int = 0  # step3p5: g_proj's outputs per query head (1: a gate per head; head_dim: per dimension)
    sinks: bool = False  # gpt_oss: one learned attention sink per head
    expert_bias: bool = False  # gpt_oss: biases on the experts' projections
    router_bias: bool = False  # gpt_oss
    # Multi-head latent attention (deepseek_v3); attention == "mla" uses these instead of num_kv_heads/head_dim.
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    # Query heads per layer where layers differ (step3p5: 96 on sliding-window layers, 64 on full ones); () when
    # every layer has num_heads.
    layer_heads: tuple[int, ...] = ()
    # MTP layers (moeflow.families.mtp), after the main layers: each one's query heads and whether its FFN is
    # MoE (else dense); mtp_embedding: each holds its own embedding (DeepSeek-V3).
    mtp_heads: tuple[int, ...] = ()
    mtp_moe: tuple[bool, ...] = ()
    mtp_embedding: bool = False
    # The attention masks transformers builds per forward, one per attention type of the main layers (full,
    # sliding window: config layer_types), each [micro-batch, 1, L, L] booleans with sdpa or eager attention.
    attention_masks: int = 1

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def heads(self, layer: int) -> int:
        """Query heads of main layer ``layer``."""
        return self.layer_heads[layer] if self.layer_heads else self.num_heads

    @property
    def mtp_layers(self) -> int:
        return len(self.mtp_heads)


def resolve_vocab_size(config_fields: Mapping[str, Any], tokenizer_vocab: int | None) -> int:
    """``model.config.vocab_size`` when present (large published configs), else the tokenizer's size."""
    vocab = config_fields.get("vocab_size") or tokenizer_vocab
    if not vocab:
        raise PlanError("no vocabulary size: set model.config.vocab_size or tokenizer.vocab_size")
    return int(vocab)


# A dense architecture's config (moeflow.checkpoint.dense_export: the dense twin's export) is planned as its MoE family
# with no MoE layer: these are the MoE keys it does not have.
NO_EXPERTS = {
    "num_experts": 0,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 0,
    "shared_expert_intermediate_size": 0,
}


def model_shape(config_fields: Mapping[str, Any], vocab_size: int) -> Shape:
    model_type = config_fields.get("model_type")
    if model_type in DENSE_OF:
        model_type = DENSE_OF[model_type].model_type
        config_fields = {**NO_EXPERTS, **config_fields, "model_type": model_type}
    if model_type not in PLANNED:
        raise PlanError(
            f"config key 'model.config.model_type': the planner knows {', '.join(sorted(PLANNED))}; got {model_type!r}"
        )
    try:
        fields = FAMILIES[model_type].shape(config_fields)
    except ConfigFieldError as error:
        raise PlanError(str(error)) from None
    fields.setdefault("attention_masks", mask_kinds(config_fields, fields["num_layers"]))
    return Shape(model_type=model_type, vocab_size=int(vocab_size), **fields)


class ConfigView(Mapping[str, Any]):
    """A transformers config read by key (its attribute names and aliases, defaults filled in), over the raw mapping."""

    def __init__(self, config: Any, raw: Mapping[str, Any]):
        self._config, self._raw = config, dict(raw)

    def __getitem__(self, key: str) -> Any:
        try:
            value, known = getattr(self._config, key, None), hasattr(self._config, key)
        except RuntimeError:  # transformers 5: a per-layer attribute read globally (step3p5's head counts)
            value, known = None, True
        if value is None and key in self._raw:
            return self._raw[key]
        if value is None and not known:
            raise KeyError(key)
        return value

    def __iter__(self):
        return iter(sorted(set(self._raw) | set(self._config.to_dict())))

    def __len__(self) -> int:
        return len(list(iter(self)))


def hf_config_fields(fields: Mapping[str, Any], vocab_size: int) -> tuple[Mapping[str, Any], Any]:
    """The config ``fields`` (a ``model.config`` mapping) as transformers reads them (defaults included) and the
    config object, if it knows the type."""
    from moeflow.model.configs import build_config
    from moeflow.model.folder import ModelError

    raw = dict(fields) | {"vocab_size": vocab_size}
    try:
        config = build_config(fields, vocab_size)
    except (ModelError, compat.UnsupportedOnStack, KeyError, ValueError, TypeError):  # formula only
        return raw, None
    return ConfigView(config, raw), config


def model_config_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """``model.config``, or the ``config.json`` of ``model.pretrained`` when a pretrained folder is used."""
    pretrained = typed(ModelSettings, model).pretrained
    if pretrained:
        path = Path(pretrained) / "config.json"
        if not path.is_file():
            raise PlanError(f"config key 'model.pretrained': {path} does not exist")
        return json.loads(path.read_text(encoding="utf-8"))
    return dict(model["config"])
