"""The families' registration with transformers' auto classes.

It registers Step-3.5-Flash's causal LM (transformers 5 only) and DeepSeek-V3 with its MTP layers (both stacks).

:func:`register` is called wherever moeflow builds or loads a model (moeflow.loading.factory, the sharded
loader's meta build, the planner's meta count); it is idempotent and cheap after the first call. The families'
modules import transformers' modelling code, so they are imported here on first registration only; the rest
of this module imports nothing heavy (the config check reads it while Snakemake builds the DAG).
"""

from __future__ import annotations

from moeflow.runtime import compat

# Families whose code exists in transformers 5 only: on transformers 4.57 they are refused naming the stack.
CURRENT_STACK_ONLY = ("step3p5",)

# Families whose transformers attention does not support flash-attn (``_supports_flash_attn = False``): refused
# at config check with model.attn_implementation: flash_attention_2, which would fail at load.
NO_FLASH_ATTENTION = ("step3p5",)


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

    from moeflow.model.families import deepseek_v3

    AutoModelForCausalLM.register(deepseek_v3.config_class, deepseek_v3.DeepseekV3ForCausalLM, exist_ok=True)
    if compat.is_transformers_v5():
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping

        from moeflow.model.families import step3p5

        AutoModelForCausalLM.register(step3p5.Step3p7TextConfig, step3p5.Step3p5ForCausalLM, exist_ok=True)
        # By model type, not class name: FSDP2's fully_shard swaps the class for FSDPStep3p5ForCausalLM, which a
        # class-name lookup misses, and the sharded loader then found no file tensor for the renamed weights.
        register_checkpoint_conversion_mapping(step3p5.MODEL_TYPE, step3p5.KEY_MAPPING, overwrite=True)
    _registered = True
