"""A model's shape from its config: per-family readers into the sizes the planner counts with.

The readers take ``model.config`` (or a folder's config.json) into the layer, attention, expert and vocabulary
sizes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    # MTP layers (moeflow.model.families.mtp), after the main layers: each one's query heads and whether its FFN is
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


_MISSING = object()


def _get(fields: Mapping[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of ``keys`` present (and not null) in ``fields``; an error naming them if none is."""
    for key in keys:
        if fields.get(key) is not None:
            return fields[key]
    if default is _MISSING:
        raise PlanError(
            f"config key 'model.config.{keys[0]}' is required for model_type {fields.get('model_type')!r}"
            + (f" (also read as: {', '.join(keys[1:])})" if len(keys) > 1 else "")
        )
    return default


def _attention_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    hidden = int(_get(f, "hidden_size"))
    heads = int(_get(f, "num_attention_heads"))
    return {
        "hidden_size": hidden,
        "num_layers": int(_get(f, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(_get(f, "num_key_value_heads", "num_attention_groups", default=heads)),
        "head_dim": int(_get(f, "head_dim", default=hidden // heads)),
        "tie_word_embeddings": bool(_get(f, "tie_word_embeddings", default=False)),
    }


def _qwen_moe_layers(f: Mapping[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    """qwen2_moe / qwen3_moe: MoE every ``decoder_sparse_step`` layers, except ``mlp_only_layers``."""
    step = int(_get(f, "decoder_sparse_step", default=1))
    dense = set(_get(f, "mlp_only_layers", default=[]) or [])
    return tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)


def _qwen_moe_fields(f: Mapping[str, Any]) -> dict[str, Any]:
    """The fields qwen2_moe and qwen3_moe share: attention, dense FFN, experts and where they are."""
    base = _attention_fields(f)
    experts = int(_get(f, "num_experts"))
    return base | {
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": _qwen_moe_layers(f, base["num_layers"], experts),
        "num_experts": experts,
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": int(_get(f, "moe_intermediate_size")),
    }


def _qwen3_moe(f: Mapping[str, Any]) -> dict[str, Any]:
    return _qwen_moe_fields(f) | {
        "qkv_bias": bool(_get(f, "attention_bias", default=False)),
        "o_bias": bool(_get(f, "attention_bias", default=False)),
        "qk_norm": "head",
    }


def _qwen2_moe(f: Mapping[str, Any]) -> dict[str, Any]:
    return _qwen_moe_fields(f) | {
        "shared_ffn": int(_get(f, "shared_expert_intermediate_size")),
        "shared_gate": True,
        "qkv_bias": bool(_get(f, "qkv_bias", default=True)),
    }


def _all_moe(f: Mapping[str, Any], experts_key: str) -> dict[str, Any]:
    """mixtral, granitemoe, olmoe, gpt_oss: every layer is MoE and ``intermediate_size`` is the expert width."""
    base = _attention_fields(f)
    return base | {
        "dense_ffn": 0,
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": int(_get(f, experts_key)),
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": int(_get(f, "intermediate_size")),
    }


def _mixtral(f: Mapping[str, Any]) -> dict[str, Any]:
    return _all_moe(f, "num_local_experts")


def _olmoe(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(_get(f, "attention_bias", default=False))
    return _all_moe(f, "num_experts") | {"qk_norm": "full", "qkv_bias": bias, "o_bias": bias}


def _gpt_oss(f: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(_get(f, "attention_bias", default=True))
    return _all_moe(f, "num_local_experts") | {
        "qkv_bias": bias,
        "o_bias": bias,
        "sinks": True,
        "expert_bias": True,
        "router_bias": True,
        # transformers' GptOssConfig alternates sliding-window and full layers when layer_types is not given
        "attention_masks": 2 if f.get("sliding_window") and not f.get("layer_types") else _mask_kinds(f, None),
    }


def _mask_kinds(f: Mapping[str, Any], num_layers: int | None) -> int:
    """The attention types of the main layers (config layer_types: full, sliding window): one mask each."""
    return len(set(list(f.get("layer_types") or [])[:num_layers])) or 1


def _deepseek_v3(f: Mapping[str, Any]) -> dict[str, Any]:
    base = _attention_fields(f)
    first_dense = int(_get(f, "first_k_dense_replace", default=0))
    expert_ffn = int(_get(f, "moe_intermediate_size"))
    q_lora = _get(f, "q_lora_rank", default=None)
    mtp = int(_get(f, "num_nextn_predict_layers", default=0))  # MoE layers with their own embedding
    return base | {
        "mtp_heads": (base["num_heads"],) * mtp,
        "mtp_moe": (True,) * mtp,
        "mtp_embedding": True,
        "attention": "mla",
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": tuple(range(first_dense, base["num_layers"])),
        "num_experts": int(_get(f, "n_routed_experts")),
        "top_k": int(_get(f, "num_experts_per_tok")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(_get(f, "n_shared_experts", default=0)) * expert_ffn,
        "q_lora_rank": int(q_lora) if q_lora is not None else None,
        "kv_lora_rank": int(_get(f, "kv_lora_rank")),
        "qk_nope_head_dim": int(_get(f, "qk_nope_head_dim")),
        "qk_rope_head_dim": int(_get(f, "qk_rope_head_dim")),
        "v_head_dim": int(_get(f, "v_head_dim")),
        "attention_bias": bool(_get(f, "attention_bias", default=False)),
    }


def _step3p5_mtp_types(f: Mapping[str, Any], key: str, mtp_key: str, n: int, m: int) -> list | None:
    """The MTP layers' entries of a per-layer list: transformers' split-off ``mtp_*`` list, or the tail of a
    list with ``n + m`` entries (the published config's, and this key's in moeflow's configs)."""
    if not m:
        return []
    if f.get(mtp_key) is not None:
        return list(f[mtp_key])
    value = f.get(key)
    return list(value[n : n + m]) if isinstance(value, list) and len(value) == n + m else None


def _step3p5(f: Mapping[str, Any]) -> dict[str, Any]:
    """Step-3.5-Flash, from transformers 5's Step3p7TextConfig keys or the published config's legacy ones: query
    heads per layer type (``num_sliding_attention_heads``, or the legacy ``attention_other_setting``'s, on
    sliding-window layers), the MTP layers (``num_nextn_predict_layers``, their types after the main layers')."""
    base = _attention_fields(f)
    n = base["num_layers"]
    m = int(_get(f, "num_nextn_predict_layers", default=0))
    other = f.get("attention_other_setting") or {}
    sliding_heads = int(
        _get(f, "num_sliding_attention_heads", default=other.get("num_attention_heads", base["num_heads"]))
    )
    layer_types = list(f.get("layer_types") or ["full_attention"] * n)[:n]
    mtp_types = _step3p5_mtp_types(f, "layer_types", "mtp_layer_types", n, m)
    if mtp_types is None:  # transformers' default for a config without per-layer types
        mtp_types = ["full_attention"] * m
    if f.get("mlp_layer_types"):
        kinds = list(f["mlp_layer_types"])
        mtp_kinds = _step3p5_mtp_types(f, "mlp_layer_types", "mtp_mlp_layer_types", n, m)
    else:
        if f.get("moe_layers_enum") is not None:
            enum = f["moe_layers_enum"]
            items = enum.split(",") if isinstance(enum, str) else enum
            moe = {int(x) for x in items if str(x).strip()}
        else:
            moe = set(range(3, n))  # transformers' default: layers 0-2 dense
        kinds = ["sparse" if i in moe else "dense" for i in range(n + m)]
        mtp_kinds = kinds[n:]
    if mtp_kinds is None:
        raise PlanError(
            f"config key 'model.config.mlp_layer_types': num_nextn_predict_layers is {m}, so it needs {n + m} entries "
            "(the main layers, then the MTP layers), or give mtp_mlp_layer_types"
        )
    moe_layers = tuple(i for i, kind in enumerate(kinds[:n]) if kind == "sparse")
    heads_of = lambda kind: sliding_heads if kind == "sliding_attention" else base["num_heads"]  # noqa: E731
    gating = f.get("gating", True)
    per_head = gating is True or gating == "per-head"
    expert_ffn = int(_get(f, "moe_intermediate_size"))
    layer_heads = tuple(heads_of(kind) for kind in layer_types)
    return base | {
        "dense_ffn": int(_get(f, "intermediate_size")),
        "moe_layers": moe_layers,
        "num_experts": int(_get(f, "n_routed_experts", "moe_num_experts", "num_local_experts")),
        "top_k": int(_get(f, "num_experts_per_tok", "moe_top_k")),
        "expert_ffn": expert_ffn,
        "shared_ffn": int(_get(f, "share_expert_dim", "share_expert_dims", default=expert_ffn)),
        "qkv_bias": bool(_get(f, "attention_bias", default=False)),
        "o_bias": bool(_get(f, "attention_bias", default=False)),
        "qk_norm": "head",
        # gate outputs per query head (one gate per head), or per head dimension; 0: no gate
        "head_gate": (1 if per_head else base["head_dim"]) if gating else 0,
        "layer_heads": layer_heads if len(set(layer_heads)) > 1 else (),
        "mtp_heads": tuple(heads_of(kind) for kind in mtp_types),
        "mtp_moe": tuple(kind == "sparse" for kind in mtp_kinds),
    }


FAMILIES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "granitemoe": _mixtral,  # the same fields and shapes (experts fused as input_linear/output_linear)
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "step3p5": _step3p5,
}


def resolve_vocab_size(config_fields: Mapping[str, Any], tokenizer_vocab: int | None) -> int:
    """``model.config.vocab_size`` when present (large published configs), else the tokenizer's size."""
    vocab = config_fields.get("vocab_size") or tokenizer_vocab
    if not vocab:
        raise PlanError("no vocabulary size: set model.config.vocab_size or tokenizer.vocab_size")
    return int(vocab)


def model_shape(config_fields: Mapping[str, Any], vocab_size: int) -> Shape:
    model_type = config_fields.get("model_type")
    if model_type not in FAMILIES:
        raise PlanError(
            f"config key 'model.config.model_type': the planner knows {', '.join(sorted(FAMILIES))}; got {model_type!r}"
        )
    fields = FAMILIES[model_type](config_fields)
    fields.setdefault("attention_masks", _mask_kinds(config_fields, fields["num_layers"]))
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
