"""Packed rows to model inputs with attention kept inside each document, for every supported family and stack.

    batch = collate(rows)                                   # CPU tensors, one micro-batch
    out = model(**model_inputs(model, batch), use_cache=False)

``model_inputs`` moves the batch to the model's device and adds the attention mask that makes a packed
document's logits equal the document run alone (verified per family and stack by tests/unit/test_families.py):

- No mask where the model's own mask builders take document boundaries from restarting ``position_ids``:
  transformers 5 (every family but gpt_oss) with eager or sdpa. ``use_cache=False`` is required (a cache
  silently disables the per-document masking).
- ``flash_attention_2``: no mask, and the micro-batch flattened to ONE packed row (1, B * L) with the
  documents' cumulative lengths (``cu_seq_lens_q/k``, ``max_length_q/k``) for flash's varlen kernel: with more
  than one row, transformers 4.57 does not read packing from ``position_ids`` and 5 leaves the flattening to
  the caller, so flash would attend across the documents of a row.
- Otherwise 4D additive masks (B, 1, L, L) in the model's dtype on its device: 0 where a query may attend
  (same document, causal, and inside the layer's sliding window where it has one), the dtype's most negative
  value elsewhere (a 4D boolean mask is silently wrong with eager attention). That is transformers 4.57 with
  eager or sdpa (torch < 2.6: no packed masks from position_ids), and gpt_oss on transformers 5 (its mask
  builders are not given position_ids). A given 4D mask replaces the model's own, sliding window included, so
  the window is built in; a model whose layers mix sliding-window and full attention (``layer_types``) gets a
  dict ``{layer type: mask}``, which the families that have such layers accept.

Rows of different lengths (the last row of a split is shorter) are padded at the end: label -100,
positions restarting at 0 (a block of their own). Causal attention means real tokens never see them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from moeflow.data.shards import IGNORE_INDEX
from moeflow.families import registry
from moeflow.runtime import compat

if TYPE_CHECKING:
    import torch

SLIDING = "sliding_attention"  # transformers' layer type of a sliding-window attention layer


# The attention implementations that get a micro-batch as one packed row (``flattens_rows``).
FLASH_ATTENTION = ("flash_attention_2",)


class PackingUnsupported(compat.UnsupportedOnStack):
    """A model whose attention moeflow cannot keep inside each packed document."""


def collate(rows: Sequence[Mapping[str, Any]], *, pad_id: int = 0) -> dict[str, Any]:
    """``input_ids``, ``labels``, ``position_ids``, ``doc_ids``: (B, L) long CPU tensors.

    ``rows`` are packed rows (lists, numpy arrays or tensors). ``doc_ids`` is -1 on padding; a row
    without the column counts as one document (0). Give the batch to the model through ``model_inputs``.
    """
    import torch

    if not rows:
        raise ValueError("collate: no rows")
    length = max(len(r["input_ids"]) for r in rows)
    input_ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.tile(np.arange(length, dtype=np.int64), (len(rows), 1))
    doc_ids = np.full((len(rows), length), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = np.asarray(row["input_ids"])
        labels[i, :n] = np.asarray(row["labels"])
        position_ids[i, :n] = np.asarray(row["position_ids"])
        position_ids[i, n:] -= n  # the batch padding restarts at 0: a block of its own
        doc_ids[i, :n] = np.asarray(row["doc_ids"]) if "doc_ids" in row else 0
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "doc_ids": torch.from_numpy(doc_ids),
    }


def token_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    """(B, L) bool: the positions that hold a real token (padding excluded from routing statistics).

    The collator marks padding with a negative ``doc_ids``; a batch without it may carry a 2D
    ``attention_mask`` (1 = token); otherwise every position counts.
    """
    import torch

    if "doc_ids" in batch:
        return torch.as_tensor(batch["doc_ids"]) >= 0
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.bool()
    return torch.ones_like(torch.as_tensor(batch["input_ids"]), dtype=torch.bool)


def model_inputs(model: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The forward's ``input_ids``, ``position_ids`` and, where the model needs it, ``attention_mask``
    (see the module doc), on the model's device. Call the model with ``use_cache=False``.

    With flash attention (:func:`flattens_rows`) the micro-batch is one packed row: ``input_ids`` and
    ``position_ids`` (1, B * L), row after row, with :func:`varlen_kwargs`. The model's outputs are then per
    token in the same order as the (B, L) batch flattened: the loss and the routing read them by token, and
    the labels stay (B, L), so the next-token shift never crosses from one row into the next."""
    from moeflow.runtime.host_copies import model_device, to_device

    device, dtype = model_device(model), next(model.parameters()).dtype
    if flattens_rows(model.config):
        flat = {k: batch[k].reshape(1, -1) for k in ("input_ids", "position_ids")}
        inputs = {k: to_device(v, device) for k, v in flat.items()}
        inputs.update(varlen_kwargs(batch["position_ids"], device))
        return inputs
    inputs = {k: to_device(batch[k], device) for k in ("input_ids", "position_ids")}
    mask = packed_attention_mask(model.config, inputs["position_ids"], dtype)
    if mask is not None:
        inputs["attention_mask"] = mask
    return inputs


def flattens_rows(config: Any) -> bool:
    """Whether the model gets each micro-batch as one packed row: flash attention keeps documents apart only
    as varlen sequences of one row (transformers 4.57 reads packing from ``position_ids`` at batch size 1
    only, transformers 5 leaves the flattening to the caller); with more rows it attends across documents."""
    return config._attn_implementation in FLASH_ATTENTION


def varlen_kwargs(position_ids: Any, device: Any) -> dict[str, Any]:
    """flash attention's varlen arguments for the (B, L) ``position_ids`` of a collated batch flattened to
    one row: ``cu_seq_lens_q/k`` (int32, a new sequence wherever the position is 0, then the total length) and
    ``max_length_q/k`` (the longest, a Python int), as transformers' ``prepare_fa_kwargs_from_position_ids``
    would compute in every layer, computed once on the host (no device sync)."""
    import torch

    from moeflow.runtime.host_copies import to_device

    flat = torch.as_tensor(position_ids).reshape(-1)
    starts = (flat == 0).nonzero().view(-1)
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = to_device(cu, device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window as the model applies it with eager/sdpa attention (None: full)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return [int(window)] * layers
    return [int(window) if kind == SLIDING else None for kind in types[:layers]]


def model_masks_documents(config: Any) -> bool:
    """Whether the model keeps packed documents apart from restarting position_ids alone (no mask given)."""
    if flattens_rows(config):
        return True
    family = registry.family(config.model_type)  # transformers 5's mask builders see documents if given positions
    return compat.is_transformers_v5() and not (family is not None and family.masks_without_positions_v5)


def packed_attention_mask(config: Any, position_ids: Any, dtype: Any):
    """None, one 4D mask, or ``{layer type: 4D mask}`` (see the module doc) for a model with ``config``."""
    if model_masks_documents(config):
        return None
    windows = layer_windows(config)
    if len(set(windows)) == 1:
        return block_causal_mask(position_ids, dtype, windows[0])
    family = registry.family(config.model_type)
    if family is None or not family.mask_per_layer_type:
        raise PackingUnsupported(
            f"packed sequences with {config.model_type!r} on transformers {compat.version_of('transformers')} and "
            f"{config._attn_implementation} attention: its layers mix sliding-window and full attention, and its "
            "decoder takes one mask for every layer, so one per-document mask would drop or impose the window. "
            "Use flash_attention_2 (GPU: each micro-batch goes to it as one packed row with its documents' "
            "cumulative lengths, and each layer applies its own window) or a configuration with the same window "
            "in every layer"
        )
    return {kind: block_causal_mask(position_ids, dtype, window) for kind, window in zip(config.layer_types, windows)}


def document_ids(position_ids: Any):
    """(B, L): the packed document each position belongs to (a new one wherever the position is 0)."""
    import torch

    return torch.cumsum((position_ids == 0).to(torch.int64), dim=1)


def block_causal_mask(position_ids: Any, dtype: Any, sliding_window: int | None = None):
    """(B, 1, L, L) additive mask from position_ids, on their device: a new block starts wherever the position
    is 0; a query attends to earlier keys of its block, the last ``sliding_window`` positions only if given."""
    import torch

    block = document_ids(position_ids)
    same_block = block[:, :, None] == block[:, None, :]
    length = position_ids.shape[1]
    index = torch.arange(length, device=position_ids.device)
    distance = index[:, None] - index[None, :]  # query minus key
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    mask = torch.zeros(same_block.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~(same_block & allowed), torch.finfo(dtype).min)
    return mask[:, None]
