"""Every family moeflow knows, by model type, and their registration with transformers' auto classes.

The records are moeflow.families.family.Family's.

:func:`register` is called wherever moeflow builds or loads a model (moeflow.loading.factory, the sharded
loader's meta build, the planner's meta count); it is idempotent and cheap after the first call. It registers
Step-3.5-Flash's causal LM (transformers 5 only) and DeepSeek-V3 with its MTP layers (both stacks). Their
modelling code imports transformers' and is imported on first registration only; the rest of this module and the
family records import nothing heavy (the config check reads them while Snakemake builds the DAG).
"""

from __future__ import annotations

from moeflow.families.deepseek_v3 import DEEPSEEK_V3
from moeflow.families.family import Family
from moeflow.families.gpt_oss import GPT_OSS
from moeflow.families.granitemoe import GRANITEMOE
from moeflow.families.mixtral import MIXTRAL
from moeflow.families.olmoe import OLMOE
from moeflow.families.qwen_moe import QWEN2_MOE, QWEN3_MOE
from moeflow.families.step3p5 import STEP3P5, STEP3P7
from moeflow.runtime import compat

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (QWEN2_MOE, QWEN3_MOE, MIXTRAL, OLMOE, DEEPSEEK_V3, GPT_OSS, GRANITEMOE, STEP3P5, STEP3P7)
}


# Families whose code exists in transformers 5 only: on transformers 4.57 they are refused naming the stack.
CURRENT_STACK_ONLY = tuple(t for t, f in FAMILIES.items() if f.current_stack_only)


# Families whose transformers attention does not support flash-attn (``_supports_flash_attn = False``): refused
# at config check with model.attn_implementation: flash_attention_2, which would fail at load.
NO_FLASH_ATTENTION = tuple(t for t, f in FAMILIES.items() if not f.flash_attention)


# The families moeflow builds MTP layers for (moeflow.families.mtp).
MTP_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.mtp)


# A dense architecture -> the family whose configs with no MoE layer are written as it
# (moeflow.checkpoint.dense_export).
DENSE_OF: dict[str, Family] = {f.dense_model_type: f for f in FAMILIES.values() if f.dense_model_type}


# The families the planner reads a shape for (moeflow.plan.shapes).
PLANNED = tuple(t for t, f in FAMILIES.items() if f.shape is not None)


def family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


def experts_fused(model_type: str | None) -> bool:
    """Whether the installed transformers keeps a layer's routed experts as fused 3-D parameters (gate and up
    projections in one ``gate_up_proj``): every family on transformers 5, GPT-OSS on both stacks."""
    known = family(model_type)
    return compat.is_transformers_v5() or (known is not None and known.gate_up_fused_v4)


def experts_in_one_tensor(model_type: str | None) -> bool:
    """Whether a layer's routed experts are one tensor (fused, or GraniteMoE's input/output_linear on 4.57)."""
    known = family(model_type)
    return experts_fused(model_type) or (known is not None and known.experts_one_tensor_v4)


_registered = False


def causal_lm_types() -> tuple[str, ...]:
    """The model types :func:`register` gives a causal-LM class on this stack (beyond transformers' own)."""
    return CURRENT_STACK_ONLY if compat.is_transformers_v5() else ()


def require_stack(model_type: str | None) -> None:
    """Refuse, naming the stack to use, a family this stack's transformers does not have."""
    if model_type in CURRENT_STACK_ONLY:
        compat.require_transformers_v5(f"model_type {model_type} (transformers 4.57 has no such model)")


def register() -> None:
    """Register moeflow's causal-LM classes with ``AutoModelForCausalLM`` (and Step-3.5's key mapping with
    transformers' checkpoint conversion), once per process."""
    global _registered
    if _registered:
        return
    from transformers import AutoModelForCausalLM

    from moeflow.families.deepseek_v3 import modeling as deepseek_v3

    AutoModelForCausalLM.register(deepseek_v3.config_class, deepseek_v3.DeepseekV3ForCausalLM, exist_ok=True)
    if compat.is_transformers_v5():
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping

        from moeflow.families.step3p5 import modeling as step3p5

        AutoModelForCausalLM.register(step3p5.Step3p7TextConfig, step3p5.Step3p5ForCausalLM, exist_ok=True)
        # By model type, not class name: FSDP2's fully_shard swaps the class for FSDPStep3p5ForCausalLM, which a
        # class-name lookup misses, and the sharded loader then found no file tensor for the renamed weights.
        register_checkpoint_conversion_mapping(STEP3P5.model_type, step3p5.KEY_MAPPING, overwrite=True)
    _registered = True
