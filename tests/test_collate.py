"""The packing-aware collator: on this stack and for each attention implementation, a packed
document's logits equal the same document run alone."""

from __future__ import annotations

import pytest
import torch

from moeflow import compat
from moeflow.collate import block_causal_mask, collate, needs_block_mask
from moeflow.modeling import build_model
from moeflow.tokenize import pack_documents

TINY_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
}
VOCAB = 64


def flash_attention_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "flash_attention_2 needs a CUDA GPU"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attention_2 needs the flash-attn package"
    return None


IMPLEMENTATIONS = [
    "eager",
    "sdpa",
    pytest.param("flash_attention_2", marks=pytest.mark.skipif(flash_attention_unavailable() is not None,
                                                               reason=str(flash_attention_unavailable()))),
]


def test_block_causal_mask_values():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(position_ids)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask.dtype == torch.float32 and mask.min() == torch.finfo(torch.float32).min
    assert block_causal_mask(position_ids, torch.bfloat16).dtype == torch.bfloat16


def test_collate_pads_rows_of_different_lengths():
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows, "sdpa", pad_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 3, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7, 8], [-100, 10, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert all(t.dtype == torch.long for k, t in batch.items() if k != "attention_mask")


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flash_attention_2"])
def test_mask_only_where_the_stack_needs_it(impl):
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 0]}]
    batch = collate(rows, impl)
    expected = impl != "flash_attention_2" and not compat.is_transformers_v5()
    assert needs_block_mask(impl) == expected
    assert ("attention_mask" in batch) == expected
    if expected:
        assert batch["attention_mask"].shape == (1, 1, 3, 3) and batch["attention_mask"].is_floating_point()
    with pytest.raises(ValueError, match="attn_implementation"):
        collate(rows, "flex")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_packed_logits_equal_each_document_alone(impl):
    device = "cuda" if impl == "flash_attention_2" else "cpu"
    dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
    model = build_model({"attn_implementation": impl, "config": TINY_MOE}, vocab_size=VOCAB, seed=0)
    model = model.to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(1)
    docs = [(i, torch.randint(3, VOCAB, (n,), generator=generator).tolist(), None) for i, n in enumerate([7, 9, 21, 5, 10], 1)]
    rows = list(pack_documents(docs, seq_len=16, pad_to_multiple_of=4, pad_id=0))
    assert [len(r["input_ids"]) for r in rows] == [16, 16, 16, 4]  # the last row is shorter: batch padding too
    batch = {k: v.to(device) for k, v in collate(rows, impl, dtype=dtype).items()}
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"), use_cache=False).logits
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        checked = 0
        for doc_id, ids, _ in docs:
            alone = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
            # where each segment of this document sits in the packed batch
            offset = 0
            for r, row in enumerate(rows):
                where = (row["doc_ids"] == doc_id).nonzero()[0]
                if len(where):
                    n = len(where)
                    segment_alone = alone[offset : offset + n] if offset == 0 else model(
                        input_ids=torch.tensor([ids[offset : offset + n]], device=device), use_cache=False).logits[0]
                    diff = (packed[r, where[0] : where[0] + n] - segment_alone).abs().max().item()
                    assert diff < tolerance, f"{impl}: document {doc_id} row {r}: max |diff| {diff}"
                    offset += n
                    checked += n
        assert checked == sum(len(ids) for _, ids, _ in docs)
