"""The MTP loss (moeflow.model.mtp_loss) against a direct full-logits computation on each packed document run
alone, with 1 and 2 MTP layers; DeepSeek-V3 on both stacks, Step-3.5-Flash (3 layers in its tiny model) on the
current one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TRANSFORMERS_5_ONLY, VOCAB, model_config

from moeflow.data.collate import collate, model_inputs
from moeflow.families.mtp import mtp_layers
from moeflow.loading.factory import make_model
from moeflow.model.chunked_loss import decoder_forward
from moeflow.model.mtp_loss import depth_targets, mtp_loss_sums
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed

CASES = [("deepseek_v3", 1), ("deepseek_v3", 2), ("step3p5", 2)]
PARAMS = [pytest.param(*c, marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="transformers 5 only"))
          if c[0] in TRANSFORMERS_5_ONLY else c for c in CASES]  # fmt: skip


def build(family: str, depth: int):
    cfg = model_config(family)
    cfg["config"]["num_nextn_predict_layers"] = depth
    model = make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=0).to(torch.float32).eval()
    assert len(mtp_layers(model)) == depth
    return model


def documents(lengths=(9, 7), seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def packed_row(docs: list[list[int]]) -> dict:
    ids = [t for d in docs for t in d]
    labels = [t for d in docs for t in [-100] + d[1:]]
    positions = [p for d in docs for p in range(len(d))]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def reference(model, doc: list[int]) -> list[float]:
    """Each depth's summed loss on one document alone: full logits, a plain loop over positions."""
    ids = torch.tensor([doc])
    positions = torch.arange(len(doc))[None]
    hidden = decoder_forward(model, {"input_ids": ids, "position_ids": positions}).last_hidden_state
    sums = []
    for k, (_, layer) in enumerate(mtp_layers(model)):
        d = k + 1
        embed = getattr(layer, "embed_tokens", None) or model.get_input_embeddings()
        n = len(doc) - d  # positions with an embedding input inside the document
        joined = torch.cat([layer.enorm(embed(ids[:, d:])), layer.hnorm(hidden[:, :n])], dim=-1)
        kind = getattr(model.config, "mtp_layer_types", None)
        pos = positions[:, :n]
        x = layer.eh_proj(joined)
        rotary = model.model.rotary_emb(x, pos, kind[k]) if kind else model.model.rotary_emb(x, pos)
        out = layer(x, position_embeddings=rotary, attention_mask=causal(n), position_ids=pos)
        hidden = out[0] if isinstance(out, tuple) else out
        logits = layer.shared_head.output_layer(layer.shared_head.norm(hidden))[0]
        total = sum(F.cross_entropy(logits[i], torch.tensor(doc[i + d + 1]), reduction="sum")
                    for i in range(n - 1))  # fmt: skip
        sums.append(float(total))
    return sums


def causal(n: int) -> torch.Tensor:
    mask = torch.full((n, n), torch.finfo(torch.float32).min, dtype=torch.float32).triu(1)
    return mask[None, None]


def packed_sums(model, docs, chunk_tokens=5) -> list[float]:
    batch = collate([packed_row(docs)])
    hidden = decoder_forward(model, model_inputs(model, batch)).last_hidden_state
    return [float(s) for s in mtp_loss_sums(model, hidden, batch, chunk_tokens)]


@pytest.mark.parametrize(("family", "depth"), PARAMS)
def test_packed_mtp_loss_equals_each_document_alone_by_full_logits(family, depth):
    model = build(family, depth)
    docs = documents()
    want = [sum(per_doc) for per_doc in zip(*(reference(model, d) for d in docs))]
    got = packed_sums(model, docs)
    assert len(got) == depth
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_depth_targets_stop_at_the_document_boundary():
    labels = torch.tensor([[-100, 11, 12, 13, -100, 21, 22]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    assert depth_targets(labels, positions, 1).tolist() == [[12, 13, -100, -100, 22, -100, -100]]
    assert depth_targets(labels, positions, 2).tolist() == [[13, -100, -100, -100, -100, -100, -100]]


def test_the_mtp_loss_trains_the_mtp_layers():
    model = build("deepseek_v3", 1)
    for _, layer in mtp_layers(model):
        layer.requires_grad_(True)
    batch = collate([packed_row(documents())])
    hidden = decoder_forward(model, model_inputs(model, batch)).last_hidden_state
    sum(mtp_loss_sums(model, hidden, batch, 4)).backward()
    _, layer = mtp_layers(model)[0]
    assert layer.eh_proj.weight.grad is not None and layer.eh_proj.weight.grad.abs().sum() > 0
