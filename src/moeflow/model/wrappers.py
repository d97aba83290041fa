"""The model inside the wrappers a layout and LoRA put around it (FSDP1, peft).

Around a transformers causal LM, the wrappers are FSDP1's ``FullyShardedDataParallel`` (the pinned stack's
``parallel.strategy: fsdp``) and peft's ``PeftModel`` (``train.method: lora``). FSDP2 and transformers' expert
parallelism keep the model's own class.
"""

from __future__ import annotations

import torch


def is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def unwrap(model: torch.nn.Module, *, peft: bool = False) -> torch.nn.Module:
    """The model inside FSDP1's wrapper (a LoRA model stays the peft model: its adapters are saved, merged and
    named through it); ``peft=True``: also inside peft's, the transformers causal LM itself."""
    inner = model.module if is_fsdp1(model) else model
    return inner.get_base_model() if peft and hasattr(inner, "get_base_model") else inner
