"""What a parameter (or module) of a transformers model is, from its name alone.

One classification for every consumer: the optimizer's groups (routers, no weight decay on norms and
biases), LoRA's choice of targets, the planner's parameter counts, the trainable-parameter report and
the active parameters per token. The names are those of both stacks' layouts (transformers 4.57's
per-expert modules and 5's fused expert parameters) and of a peft-wrapped model, whose names carry a
``base_model.model.`` prefix, ``base_layer.`` for the frozen weight and ``lora_A/B.<adapter>.`` for the
adapters: those are classified as the weight they adapt.

A module's category is the category of its ``weight``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ROUTER = "router"


ROUTED_EXPERTS = "routed_experts"


EXPERT_BIASES = "expert_biases"  # biases of fused routed experts (GPT-OSS's gate_up_proj_bias, down_proj_bias)


CORRECTION_BIAS = "correction_bias"  # DeepSeek-V3-style e_score_correction_bias (loss-free balancing)


SHARED_EXPERTS = "shared_experts"


SHARED_EXPERT_GATE = "shared_expert_gate"  # qwen2_moe's hidden -> 1 gate on the shared expert's output


ATTENTION = "attention"


DENSE_FFN = "dense_ffn"


NORMS = "norms"


EMBEDDING = "embedding"


LM_HEAD = "lm_head"


# The modules only an MTP layer has (moeflow.families.mtp); the rest of an MTP layer is named as a decoder
# layer's, and only the model knows it is one (the planner counts those by layer index).
MTP = "mtp"


# Parameter counts (the planner's, the trainable-parameter report's) use fewer categories.
COUNTED_AS = {EXPERT_BIASES: ROUTED_EXPERTS, CORRECTION_BIAS: ROUTER, SHARED_EXPERT_GATE: SHARED_EXPERTS}


PEFT_PREFIX = "base_model.model."


_LORA_PARAM = re.compile(r"\.lora_(A|B)\.[^.]+\.(weight|bias)$")


# A fused expert tensor's factors under expert parallelism (moeflow.model.expert_lora): ``<tensor>_lora_A``/``_B``.
_EXPERT_LORA_PARAM = re.compile(r"_lora_(A|B)$")


# A weight held as a parametrization (moeflow.model.quantization: its stored bytes are ``original``).
_PARAMETRIZED = re.compile(r"\.parametrizations\.([^.]+)\.original$")


_LAYER = re.compile(r"layers\.(\d+)\.")


# First match wins: the MTP modules first (enorm is no model norm), expert biases before experts, shared experts
# before routed ones and the router, attention before norms (q/k norms count with attention).
_RULES = (
    (MTP, re.compile(r"(^|\.)(enorm|hnorm|eh_proj|shared_head)\.")),
    (CORRECTION_BIAS, re.compile(r"(^|\.)e_score_correction_bias$")),
    (EXPERT_BIASES, re.compile(r"(^|\.)experts\.([^.]+_bias|.+\.bias)$")),
    (EMBEDDING, re.compile(r"(^|\.)embed_tokens\.")),
    (LM_HEAD, re.compile(r"^lm_head\.")),
    (SHARED_EXPERT_GATE, re.compile(r"(^|\.)shared_expert_gate\.")),
    (SHARED_EXPERTS, re.compile(r"(^|\.)(shared_experts?|share_expert)\.")),
    # transformers 4.57's GraniteMoE keeps its experts fused in block_sparse_moe.input_linear/output_linear
    (ROUTED_EXPERTS, re.compile(r"(^|\.)(experts|block_sparse_moe\.(input|output)_linear)\.")),
    # transformers 4.57's GraniteMoE keeps its router's weight in a child Linear: router.layer.weight
    (ROUTER, re.compile(r"(^|\.)(gate|router)\.(layer\.)?(weight|bias)$")),
    (ATTENTION, re.compile(r"(^|\.)(self_attn|attention)\.")),
    (NORMS, re.compile(r"norm[^.]*\.[^.]+$")),
    (DENSE_FFN, re.compile(r"(^|\.)(mlp|feed_forward)\.")),
)


def base_name(name: str) -> str:
    """The name in the plain model of the weight a (possibly peft-wrapped, possibly quantized) parameter is or
    adapts."""
    name = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
    name = _EXPERT_LORA_PARAM.sub("", _LORA_PARAM.sub(".weight", name.replace(".base_layer", "")))
    return _PARAMETRIZED.sub(r".\1", name)


def is_adapter(name: str) -> bool:
    """A LoRA adapter's own parameter (peft's lora_A/lora_B, or an expert tensor's factor under expert
    parallelism)."""
    return bool(_LORA_PARAM.search(name) or _EXPERT_LORA_PARAM.search(name))


def category(name: str) -> str | None:
    """The category of a parameter name (plain or peft), or None for a name none of the rules knows."""
    name = base_name(name)
    return next((cat for cat, rule in _RULES if rule.search(name)), None)


def module_category(name: str) -> str | None:
    """The category of a module name (that of its weight)."""
    return category(f"{name}.weight")


def counted_category(name: str) -> str | None:
    """The category parameter counts report a parameter under (``COUNTED_AS`` merges the small ones)."""
    cat = category(name)
    return COUNTED_AS.get(cat, cat)


def is_bias(name: str) -> bool:
    """A bias: ``.bias`` of a module, a fused expert bias, or an expert-load correction bias."""
    return category(name) in (EXPERT_BIASES, CORRECTION_BIAS) or base_name(name).endswith(".bias")


def takes_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """AdamW's rule: weight decay on weights of 2 or more dimensions, never on norms and biases (also
    those stored as 2-D tensors, such as GPT-OSS's per-expert biases). ``shape``: as in the model."""
    return len(shape) >= 2 and category(name) != NORMS and not is_bias(name)


# The categories whose weights are linear maps between hidden features (Muon's matrices); the embedding, the LM
# head, the routers, the shared-expert gate and the MTP modules are not.
HIDDEN_MATRIX_CATEGORIES = (ATTENTION, DENSE_FFN, ROUTED_EXPERTS, SHARED_EXPERTS)


def is_hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """A hidden layer's weight matrix, which Muon updates (moeflow.train.optimizers): an attention, dense-FFN or
    expert weight of 2 dimensions, or of 3 where the stack fuses a layer's experts into one ``[E, out, in]``
    tensor (each expert's slice is one matrix). Never a norm or bias. ``shape``: as in the model."""
    return category(name) in HIDDEN_MATRIX_CATEGORIES and takes_weight_decay(name, shape)


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to (None outside the layers)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def clean_name(name: str) -> str:
    """A parameter's name as the model names it, without the FSDP1 and activation-checkpointing wrappers'
    prefixes."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def active_per_token(config: Any, sizes: Mapping[str, int]) -> int:
    """Parameters one token passes through, from the model's config and each parameter's whole size by name:
    everything but the routed experts a token does not use. Six times this is the training FLOPs per token."""
    experts = (
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    top_k = getattr(config, "num_experts_per_tok", None)
    total = sum(sizes.values())
    if not experts or not top_k:
        return total
    expert_params = sum(k for n, k in sizes.items() if counted_category(n) == ROUTED_EXPERTS)
    return int(total - expert_params + expert_params * top_k / experts)


def flop_bearing_per_token(config: Any, sizes: Mapping[str, int]) -> int:
    """The active parameters per token that do a matmul (the MFU's count, ``6 *`` this per trained token):
    :func:`active_per_token` without the input embedding, whose lookup is a gather, not a matmul. A head tied to
    the embedding is one parameter in ``sizes`` (under the embedding's name, no ``lm_head`` entry): it counts
    once, as the head."""
    names = {clean_name(n): k for n, k in sizes.items()}
    embedding = {n: k for n, k in names.items() if category(n) == EMBEDDING}
    tied_head = not any(category(n) == LM_HEAD for n in names)
    kept = {n: k for n, k in names.items() if n not in embedding}
    return active_per_token(config, kept) + (sum(embedding.values()) if tied_head else 0)
