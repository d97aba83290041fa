"""The packing-aware collator: the rows' tensors, and the masks ``model_inputs`` gives each kind of model.
Packed == alone for every family and stack is tests/unit/test_families.py's; flash_attention_2 (GPU) is here."""

from __future__ import annotations

from types import SimpleNamespace

import family_checks as C
import pytest
import torch
from tiny_models import WINDOW, build_family, tiny_model_cfg

from moeflow.data.collate import (
    PackingUnsupported,
    block_causal_mask,
    collate,
    layer_windows,
    model_inputs,
    packed_attention_mask,
)
from moeflow.data.packing import pack_documents
from moeflow.model.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed

VOCAB = 64


def allowed(mask: torch.Tensor) -> list[list[int]]:
    return (mask[0, 0] == 0).int().tolist()


def test_block_causal_mask_values():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(position_ids, torch.float32)
    assert allowed(mask) == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask.dtype == torch.float32 and mask.min() == torch.finfo(torch.float32).min
    assert block_causal_mask(position_ids, torch.bfloat16).dtype == torch.bfloat16


def test_block_causal_mask_keeps_the_sliding_window():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 3, 0, 1]]), torch.float64, sliding_window=2)
    assert allowed(mask) == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]


def test_collate_pads_rows_of_different_lengths():
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows, pad_id=3)
    assert set(batch) == {"input_ids", "labels", "position_ids", "doc_ids"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 3, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7, 8], [-100, 10, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 0], [0, 0, -1, -1]]
    assert all(t.dtype == torch.long for t in batch.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_model_inputs_give_the_masks_the_model_uses(family):
    """One mask with the window built in, a dict per layer type for mixed layers, none where position_ids do
    it; in the model's dtype."""
    model = build_family(family, "eager", torch.float64)
    inputs = model_inputs(model, collate(C.packed_rows()))
    mask = inputs.get("attention_mask")
    if compat.is_transformers_v5() and family != "gpt_oss":
        assert mask is None
    elif family == "gpt_oss":
        assert set(mask) == {"sliding_attention", "full_attention"}
        assert allowed(mask["full_attention"])[31][:12] == [0] * 12  # the second document does not see the first
        assert sum(allowed(mask["sliding_attention"])[31]) == WINDOW and sum(allowed(mask["full_attention"])[31]) == 20
        assert all(m.dtype == torch.float64 for m in mask.values())
    else:
        assert mask.shape == (3, 1, 32, 32) and mask.dtype == torch.float64
        assert sum(allowed(mask)[31]) == WINDOW
    windows = {"qwen3_moe": [WINDOW] * 2, "mixtral": [WINDOW] * 2, "gpt_oss": [WINDOW, None]}
    assert layer_windows(model.config) == windows[family]


def test_mixed_windows_for_a_model_that_takes_one_mask_are_refused():
    config = SimpleNamespace(
        model_type="mixtral",
        _attn_implementation="eager",
        num_hidden_layers=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    position_ids = torch.tensor([[0, 1, 2, 0]])
    if compat.is_transformers_v5():  # the model's own mask builders see the documents and the window
        assert packed_attention_mask(config, position_ids, torch.float32) is None
    else:
        with pytest.raises(PackingUnsupported, match="mix sliding-window and full attention.*flash_attention_2"):
            packed_attention_mask(config, position_ids, torch.float32)


def flash_attention_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "flash_attention_2 needs a CUDA GPU"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attention_2 needs the flash-attn package"
    return None


@pytest.mark.skipif(flash_attention_unavailable() is not None, reason=str(flash_attention_unavailable()))
def test_flash_attention_packed_logits_equal_each_document_alone():
    model = make_model(typed(ModelSettings, tiny_model_cfg("flash_attention_2")), vocab_size=VOCAB, seed=0)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    docs = [(i, torch.randint(3, VOCAB, (n,), generator=generator).tolist(), None) for i, n in enumerate([7, 9, 12], 1)]
    rows = list(pack_documents(docs, seq_len=16, pad_to_multiple_of=4, pad_id=0))
    inputs = model_inputs(model, collate(rows))
    assert "attention_mask" not in inputs and inputs["input_ids"].device.type == "cuda"
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits
        for doc_id, ids, _ in docs:
            r = next(r for r, row in enumerate(rows) if (row["doc_ids"] == doc_id).any())
            where = (rows[r]["doc_ids"] == doc_id).nonzero()[0]
            alone = model(input_ids=torch.tensor([ids[: len(where)]], device="cuda"), use_cache=False).logits[0]
            assert (packed[r, where[0] : where[0] + len(where)] - alone).abs().max().item() < 2e-2
