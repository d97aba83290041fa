"""Packed rows to model inputs with attention kept inside each document, per stack.

The model forward is the same everywhere::

    batch = collate(rows, attn_implementation)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=batch.get("attention_mask"), use_cache=False)

How documents are kept apart differs by stack (verified: packed logits equal each document alone):

- transformers 5, any implementation: ``position_ids`` that restart at 0 and *no* attention mask;
  ``use_cache=False`` is required (a cache silently disables the per-document masking).
- transformers 4.x with ``eager`` or ``sdpa``: position_ids are ignored as boundaries, so a 4D
  additive float mask (B, 1, L, L) is passed: 0 inside a document's causal block, the dtype's most
  negative value elsewhere. (A 4D boolean mask is silently wrong with eager attention.)
- ``flash_attention_2`` (GPU) on both stacks: restarting position_ids, no mask.

Rows of different lengths (the last row of a split is shorter) are padded at the end: label -100,
positions restarting at 0 (a block of their own). Causal attention means real tokens never see them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from . import compat

IGNORE_INDEX = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")  # what a batch passes to the model's forward
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def needs_block_mask(attn_implementation: str) -> bool:
    """Whether this stack and attention implementation need the 4D block-causal mask."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}")
    return attn_implementation != "flash_attention_2" and not compat.is_transformers_v5()


def block_causal_mask(position_ids: Any, dtype: Any = None):
    """(B, 1, L, L) additive float mask from position_ids: a new block starts wherever the position is 0."""
    import torch

    dtype = dtype or torch.float32
    block = torch.cumsum((position_ids == 0).to(torch.int64), dim=1)
    same_block = block[:, :, None] == block[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    mask = torch.zeros(same_block.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~(same_block & causal), torch.finfo(dtype).min)
    return mask[:, None]


def collate(rows: Sequence[Mapping[str, Any]], attn_implementation: str, dtype: Any = None, pad_id: int = 0) -> dict[str, Any]:
    """``input_ids``, ``labels``, ``position_ids``, ``doc_ids`` (B, L) long tensors, plus ``attention_mask``
    (B, 1, L, L, ``dtype``, default float32) only where the stack needs it (see the module doc).

    ``rows`` are packed rows (lists, numpy arrays or tensors). ``doc_ids`` is -1 on padding; a row
    without the column counts as one document (0). Pass only ``MODEL_INPUTS`` to the model.
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
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "doc_ids": torch.from_numpy(doc_ids),
    }
    if needs_block_mask(attn_implementation):
        batch["attention_mask"] = block_causal_mask(batch["position_ids"], dtype)
    return batch
