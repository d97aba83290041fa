"""The multi-token-prediction loss of DeepSeek-V3 (arXiv 2412.19437 section 2.2) over packed rows, by chunks.

Depth ``d`` (1..D) joins ``hnorm(h^{d-1}_i)`` and ``enorm(Emb(t_{i+d}))`` through ``eh_proj``, runs its MTP
layer (moeflow.families.mtp) with the row's positions and per-document mask, and predicts
``t_{i+d+1}`` through its shared head, with moeflow.model.chunked_loss (the full logits are never built).
``h^0`` is the main decoder's last hidden state. A target whose token lies in another packed document than
position ``i`` counts nothing; such positions are a document's last ``d + 1``, and no later position of the
document is a target, so the next document's embedding at them reaches no counted loss through the causal,
per-document attention. The caller divides each depth's sum by the step's label tokens, as the main loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from moeflow.data.collate import SLIDING, block_causal_mask, document_ids, flattens_rows
from moeflow.data.shards import IGNORE_INDEX
from moeflow.families.mtp import mtp_units
from moeflow.model.chunked_loss import linear_cross_entropy, logit_scale
from moeflow.model.wrappers import unwrap
from moeflow.runtime.host_copies import to_device


def depth_targets(labels: torch.Tensor, position_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, L): position ``i``'s depth-``depth`` target ``labels[i + depth + 1]``, IGNORE_INDEX where that lies
    past the row or in another document than ``i``."""
    shift = depth + 1
    targets = F.pad(labels, (0, shift), value=IGNORE_INDEX)[:, shift:]
    docs = document_ids(position_ids)
    later = F.pad(docs, (0, shift), value=-1)[:, shift:]
    return targets.masked_fill(later != docs, IGNORE_INDEX)


def _layer_kwargs(model: Any, layer_index: int, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
    decoder = model.model
    config = model.config
    kinds = getattr(config, "mtp_layer_types", None)
    kind = kinds[layer_index] if kinds else None
    if kind is not None:
        rotary = decoder.rotary_emb(hidden, position_ids, kind)
    else:
        rotary = decoder.rotary_emb(hidden, position_ids)
    if flattens_rows(config):
        raise NotImplementedError(
            f"the MTP loss runs its layers with eager or sdpa attention only, not {config._attn_implementation}; "
            "set model.attn_implementation to sdpa for a run with train.mtp.mode train"
        )
    # The MTP layer is called directly, so the decoder's own per-document mask never reaches it: build it here.
    window = getattr(config, "sliding_window", None) if kind == SLIDING else None
    mask = block_causal_mask(position_ids, hidden.dtype, window)
    return {"position_embeddings": rotary, "attention_mask": mask, "position_ids": position_ids}


def mtp_loss_sums(model: Any, last_hidden: torch.Tensor, batch: dict, chunk_tokens: int) -> list[torch.Tensor]:
    """Each MTP depth's summed cross-entropy (module docstring) for one micro-batch of (B, L) rows.

    ``last_hidden`` (B, L, H): the main decoder's output on ``batch`` (its ``input_ids``, ``labels``,
    ``position_ids``)."""
    units = mtp_units(model)
    if not units:
        raise ValueError(f"{model.config.model_type}: the model has no MTP layers, so it has no MTP loss")
    input_ids, labels = batch["input_ids"], batch["labels"]
    position_ids = batch["position_ids"]
    embed = model.get_input_embeddings()
    scale = logit_scale(model.config)
    hidden, sums = last_hidden, []
    for k, unit in enumerate(units):
        depth = k + 1
        ids = F.pad(input_ids, (0, depth), value=0)[:, depth:]  # t_{i+depth}; the row's tail gets a pad id
        targets = depth_targets(labels, position_ids, depth).reshape(-1)

        def loss(normed: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor = targets) -> torch.Tensor:
            flat = normed.reshape(-1, normed.shape[-1])
            return linear_cross_entropy(flat, weight, targets, chunk_tokens=chunk_tokens, scale=scale)[0]

        depth_inputs = {
            "previous": hidden,
            "next_ids": ids,
            # the layer's own embedding (DeepSeek-V3's), or the model's: it runs in the root unit, which FSDP keeps
            # gathered from forward to backward (FSDP1's and the checkpoint wrapper hand attributes through)
            "next_embeddings": None if hasattr(unit, "embed_tokens") else embed(ids),
            "layer_kwargs": _layer_kwargs(model, k, hidden, position_ids),
            "loss": loss,
        }
        depth_sum, hidden = unit(mtp_depth=depth_inputs)  # one call: FSDP gathers the whole depth (MTPLayer)
        sums.append(depth_sum)
    return sums


def mtp_sums(model: Any, outputs: Any, batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """:func:`mtp_loss_sums` continuing from a forward of ``model`` (in any wrapper) that kept its last hidden
    state (``outputs``), on ``batch`` as collated (moved to the hidden state's device here)."""
    lm = unwrap(model)
    device = outputs.last_hidden_state.device
    on_device = {k: to_device(batch[k], device) for k in ("input_ids", "labels", "position_ids")}
    return mtp_loss_sums(lm, outputs.last_hidden_state, on_device, lm.loss_chunk_tokens)
