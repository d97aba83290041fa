"""Multi-token prediction (MTP) layers carried with a model under the published checkpoints' names.

Multi-token prediction (MTP) layers carried with a model: built, loaded, frozen, checkpointed and exported
under the names of the published checkpoints, so that a fine-tuned folder still serves with speculative
decoding (vLLM's MTP loaders raise when the tensors are missing).

DeepSeek-V3 and Step-3.5-Flash publish their MTP layers as trailing decoder layers,
``model.layers.<num_hidden_layers + i>.*``: the decoder layer's own tensors plus ``enorm`` (the next token's
embedding), ``hnorm`` (the previous hidden state), ``eh_proj`` (``2H -> H`` over their concatenation) and a
``shared_head`` (a norm and an output layer; DeepSeek-V3 names it ``head``, Step-3.5 ``output``); DeepSeek-V3's
also holds its own ``embed_tokens``. transformers drops them as unexpected keys at load. Here each MTP layer is
the family's decoder-layer class with those modules added (:func:`add_mtp_modules`), appended to
``model.layers`` after the main layers; the decoders' forward runs ``layers[:num_hidden_layers]`` only, so the
main model's outputs are unchanged.

The MTP depth ``k`` (0-based) predicts token ``t + k + 2`` from the depth's previous hidden state at ``t`` and
the embedding of token ``t + k + 1``: :func:`mtp_hidden` is that step (DeepSeek-V3 section 2.2); the MTP
loss is moeflow.model.mtp_loss. Their parameters are built frozen (``requires_grad`` off, in the layer classes,
so every build and load path has them so): with ``train.mtp.mode: frozen`` (the default) the training loop
never runs them, AdamW holds no state for them, and LoRA gives them no adapters; ``train.mtp.mode: train``
turns them on (moeflow.train.trainer.train_mtp_layers) and adds their loss to the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Set on the MTP layer classes: what tells an MTP layer from a decoder layer (they share names and classes).
MTP_FLAG = "is_mtp_layer"


class MTPSharedHead(nn.Module):
    """The MTP layer's final norm and output layer, under the published checkpoint's names (``norm`` and
    ``head_name``)."""

    def __init__(self, norm: nn.Module, hidden_size: int, vocab_size: int, head_name: str):
        super().__init__()
        self.norm = norm
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(hidden_size, vocab_size, bias=False))

    @property
    def output_layer(self) -> nn.Linear:
        return getattr(self, self.head_name)


def add_mtp_modules(
    layer: nn.Module,
    hidden_size: int,
    vocab_size: int,
    make_norm: Callable[[], nn.Module],
    head_name: str,
    own_embedding: bool = False,
) -> None:
    """Give a freshly built decoder layer the MTP modules of the published layout (module docstring)."""
    layer.enorm = make_norm()
    layer.hnorm = make_norm()
    layer.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
    layer.shared_head = MTPSharedHead(make_norm(), hidden_size, vocab_size, head_name)
    if own_embedding:
        layer.embed_tokens = nn.Embedding(vocab_size, hidden_size)


def mtp_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every MTP layer in the model (inside any FSDP or PEFT wrapper), in order."""
    return [(name, m) for name, m in model.named_modules() if getattr(type(m), MTP_FLAG, False)]


def mtp_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The module-name prefixes (``...layers.45.``) of the model's MTP layers."""
    return tuple(f"{name}." for name, _ in mtp_layers(model))


def is_mtp_name(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a parameter, buffer or module name lies inside one of the MTP layers ``prefixes``."""
    return any(name.startswith(prefix) or f".{prefix}" in f".{name}" for prefix in prefixes)


def mtp_report(model: nn.Module) -> dict[str, Any] | None:
    """What the run summary says about the model's MTP layers (None when it has none): how many, their
    parameters, and whether any of them trained."""
    layers = mtp_layers(model)
    if not layers:
        return None
    params = [p for _, layer in layers for p in layer.parameters()]
    trained = any(p.requires_grad for p in params)
    return {
        "layers": len(layers),
        "parameters": sum(p.numel() for p in params),
        "trained": trained,
        "note": "trained with the MTP loss (train.mtp.mode: train)"
        if trained
        else "not trained: carried frozen from the base model into the checkpoints and the export "
        "(train.mtp.mode: frozen)",
    }


def mtp_hidden(
    layer: nn.Module, previous_hidden: torch.Tensor, next_embeddings: torch.Tensor, **layer_kwargs: Any
) -> torch.Tensor:
    """One MTP depth: ``shared_head.norm(layer(eh_proj([enorm(next_embeddings); hnorm(previous_hidden)])))``;
    the depth's logits are ``layer.shared_head.output_layer`` of it. ``layer_kwargs``: what the decoder layer's
    forward takes (position embeddings, attention mask)."""
    joined = torch.cat([layer.enorm(next_embeddings), layer.hnorm(previous_hidden)], dim=-1)
    hidden = layer(layer.eh_proj(joined), **layer_kwargs)
    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return layer.shared_head.norm(hidden)
