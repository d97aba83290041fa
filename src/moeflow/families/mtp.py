"""Multi-token prediction (MTP) layers carried with a model under the published checkpoints' names.

The layers are built, loaded, frozen, checkpointed and exported under those names, so that a fine-tuned folder
still serves with speculative decoding (vLLM's MTP loaders raise when the tensors are missing).

DeepSeek-V3 and Step-3.5-Flash publish their MTP layers as trailing decoder layers,
``model.layers.<num_hidden_layers + i>.*``: the decoder layer's own tensors plus ``enorm`` (the next token's
embedding), ``hnorm`` (the previous hidden state), ``eh_proj`` (``2H -> H`` over their concatenation) and a
``shared_head`` (a norm and an output layer; DeepSeek-V3 names it ``head``, Step-3.5 ``output``); DeepSeek-V3's
also holds its own ``embed_tokens``. transformers drops them as unexpected keys at load. Here each MTP layer is
the family's decoder-layer class with those modules added (:func:`add_mtp_modules`), appended to
``model.layers`` after the main layers; the decoders' forward runs ``layers[:num_hidden_layers]`` only, so the
main model's outputs are unchanged.

The MTP depth ``k`` (0-based) predicts token ``t + k + 2`` from the depth's previous hidden state at ``t`` and
the embedding of token ``t + k + 1``: :meth:`MTPLayer.depth` is that step (DeepSeek-V3 section 2.2), run in one
call of the layer so that FSDP covers it; the MTP loss is moeflow.model.mtp_loss. Their parameters are built
frozen (``requires_grad`` off, in the layer classes, so every build and load path has them so): with
``train.mtp.mode: frozen`` (the default) the training loop never runs them, AdamW holds no state for them, and
LoRA gives them no adapters; ``train.mtp.mode: train`` turns them on (:func:`unfreeze_mtp_layers`)
and adds their loss to the step's.
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


def unfreeze_mtp_layers(model: nn.Module) -> int:
    """``train.mtp.mode: train``: the MTP layers' parameters get gradients (they are built frozen); returns how
    many layers. moeflow.loading.factory does it as it builds a model for training, before any forward: FSDP2 fixes
    each unit's gradient and reduction dtypes at its first forward from the parameters that require grad then, so
    a unit unfrozen after a forward (warmup's base reference) had bf16 gradients assigned to fp32 parameters."""
    layers = mtp_layers(model)
    for _, layer in layers:
        layer.requires_grad_(True)
    return len(layers)


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


class MTPLayer(nn.Module):
    """The first base of a family's MTP layer class (its decoder-layer class second): called as a decoder layer,
    or with ``mtp_depth=`` as one whole MTP depth (:meth:`depth`). One call for the depth is what FSDP needs: it
    gathers a unit's parameters around the unit's forward and reduces their gradients after its backward, so
    enorm, hnorm, eh_proj, the own embedding and the shared head must run inside that forward, not beside it."""

    is_mtp_layer = True  # MTP_FLAG

    def forward(self, *args: Any, mtp_depth: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if mtp_depth is None:
            return super().forward(*args, **kwargs)
        return self.depth(**mtp_depth)

    def depth(
        self,
        previous: torch.Tensor,
        next_ids: torch.Tensor,
        next_embeddings: torch.Tensor | None,
        layer_kwargs: dict[str, Any],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP depth (DeepSeek-V3 section 2.2): ``h = layer(eh_proj([enorm(emb(next_ids)); hnorm(previous)]))``
        with ``next_embeddings`` (the model's embedding of ``next_ids``), or None for the layer's own embedding,
        and ``loss`` of ``shared_head.norm(h)`` and the shared head's output weight. Returns (that loss, ``h``: the
        next depth's ``previous``). ``layer_kwargs``: what the decoder layer's forward takes (position embeddings,
        mask)."""
        embedded = self.embed_tokens(next_ids) if next_embeddings is None else next_embeddings
        joined = torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1)
        out = super().forward(self.eh_proj(joined), **layer_kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        head = self.shared_head
        return loss(head.norm(hidden), head.output_layer.weight), hidden


_WRAPPER_SUFFIXES = ("._fsdp_wrapped_module", "._checkpoint_wrapped_module")


def mtp_units(model: nn.Module) -> list[nn.Module]:
    """The module to call for each MTP layer, in order: the layer, or the FSDP1 or checkpoint wrapper around it
    (calling the layer inside an FSDP1 wrapper would skip the gathering of its parameters)."""
    units = []
    for name, _ in mtp_layers(model):
        while name.endswith(_WRAPPER_SUFFIXES):
            name = name.rsplit(".", 1)[0]
        units.append(model.get_submodule(name))
    return units
