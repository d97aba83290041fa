"""The packing-aware collator: the rows' tensors, and the masks ``model_inputs`` gives each kind of model.
Packed == alone for every family and stack is tests/unit/test_families.py's; flash_attention_2 is here (on a GPU
with flash-attn, and on CPU with a stand-in that attends as transformers' flash path does)."""

from __future__ import annotations

import contextlib
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
from moeflow.loading.factory import make_model
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
    batch = collate(rows)
    inputs = model_inputs(model, batch)
    assert "attention_mask" not in inputs and inputs["input_ids"].device.type == "cuda"
    assert inputs["input_ids"].shape == (1, batch["input_ids"].numel())  # one packed row
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits.view(*batch["input_ids"].shape, -1)
        for doc_id, ids, _ in docs:
            r = next(r for r, row in enumerate(rows) if (row["doc_ids"] == doc_id).any())
            where = (rows[r]["doc_ids"] == doc_id).nonzero()[0]
            alone = model(input_ids=torch.tensor([ids[: len(where)]], device="cuda"), use_cache=False).logits[0]
            assert (packed[r, where[0] : where[0] + len(where)] - alone).abs().max().item() < 2e-2


VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class FakeFlash:
    """flash_attention_2 on CPU: records what each attention call gets and attends as transformers' flash path
    would (``_flash_attention_forward``): over the given cumulative lengths; else over the sequences
    ``prepare_fa_kwargs_from_position_ids`` finds when ``_is_packed_sequence`` says the row is packed (batch size
    1 only); else causally over each whole row, across its documents."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kw):
        from transformers.modeling_flash_attention_utils import (
            _is_packed_sequence,
            prepare_fa_kwargs_from_position_ids,
        )

        batch, heads, length, _ = query.shape
        position_ids = kw.get("position_ids")
        self.calls.append(
            {"batch": batch, "mask": attention_mask, "position_ids": position_ids, **{k: kw.get(k) for k in VARLEN}}
        )
        if all(kw.get(k) is not None for k in VARLEN):
            cu = kw["cu_seq_lens_q"].tolist()
        elif _is_packed_sequence(position_ids, batch):
            cu = prepare_fa_kwargs_from_position_ids(position_ids)[0][0].tolist()
        else:
            cu = [r * length for r in range(batch + 1)]  # each row one sequence
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1]) for t in (query, key, value))
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = torch.zeros(batch * length, heads, value.shape[-1], dtype=query.dtype)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        for start, end in zip(cu[:-1], cu[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
            distance = torch.arange(end - start)[:, None] - torch.arange(end - start)[None, :]
            allowed = (distance >= 0) & (distance < sliding_window if sliding_window else True)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v[start:end])
        return out.view(batch, length, heads, -1), None


@contextlib.contextmanager
def fake_flash(model):
    """``model`` attends through a recording FakeFlash registered as flash_attention_2, for the block only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fake = FakeFlash()
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = fake
    model.config._attn_implementation = "flash_attention_2"
    try:
        yield fake
    finally:
        del ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
        model.config._attn_implementation = "eager"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_flash_attention_gets_one_packed_row_with_the_documents_lengths(family):
    """Rows of several documents reach a flash model as ONE packed row with the cumulative lengths transformers'
    own varlen preparation finds from its position_ids; the per-token losses equal the per-document (masked)
    attention's, and the next-token shift does not cross from one row into the next."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from moeflow.model.chunked_loss import token_losses

    dtype = C.dtype_for(family)
    model = build_family(family, "eager", dtype).eval()
    batch = collate(C.packed_rows())
    assert batch["input_ids"].shape[0] == 3 and (batch["position_ids"] == 0).sum(1).tolist() == [2, 2, 4]
    with torch.no_grad():
        reference = token_losses(model, model_inputs(model, batch), batch["labels"]).token_loss
    with fake_flash(model) as fake, torch.no_grad():
        inputs = model_inputs(model, batch)
        flash = token_losses(model, inputs, batch["labels"]).token_loss
    assert "attention_mask" not in inputs and inputs["input_ids"].shape == (1, 3 * 32)
    assert torch.equal(inputs["input_ids"], batch["input_ids"].reshape(1, -1))
    (want_cu, _), (want_max, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"].reshape(1, -1))
    assert fake.calls and all(call["batch"] == 1 and call["mask"] is None for call in fake.calls)
    for call in fake.calls:
        assert torch.equal(call["cu_seq_lens_q"], want_cu) and torch.equal(call["cu_seq_lens_k"], want_cu)
        assert call["max_length_q"] == call["max_length_k"] == int(want_max)
    assert want_cu.tolist() == [0, 12, 32, 37, 64, 73, 80, 84, 96]  # the last row's padding: a block of its own
    assert flash.shape == batch["labels"].shape
    assert (flash - reference).abs().max() < C.tolerance(dtype)


def test_unflattened_rows_would_attend_across_documents():
    """The fake is a faithful check: rows of several documents given to it as they are (B > 1) attend across
    their documents, and the losses move."""

    from moeflow.model.chunked_loss import token_losses

    model = build_family("qwen3_moe", "eager", torch.float64).eval()
    batch = collate(C.packed_rows())
    with torch.no_grad():
        reference = token_losses(model, model_inputs(model, batch), batch["labels"]).token_loss
        with fake_flash(model) as fake:
            rows = {k: batch[k] for k in ("input_ids", "position_ids")}
            crossing = token_losses(model, rows, batch["labels"]).token_loss
    assert fake.calls and fake.calls[0]["batch"] == 3
    assert (crossing - reference).abs().max() > 1e-3
