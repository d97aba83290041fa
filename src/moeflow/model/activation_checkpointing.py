"""Activation checkpointing of a transformers model, reentrant or not, on both stacks.

Whether it is reentrant decides which parameters get gradients: reentrant checkpointing gives none to a
parameter behind a checkpointed layer whose inputs do not require grad (a LoRA adapter on a frozen base), so
moeflow turns it on non-reentrant (moeflow.model.lora).
"""

from __future__ import annotations


def enable_activation_checkpointing(model: object, reentrant: bool = False) -> None:
    """``activation_checkpointing_enable`` on transformers 5 (which renamed it; the old name warns there),
    ``gradient_checkpointing_enable`` on 4.57."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
