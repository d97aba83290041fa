"""The training maths against independent references: accumulated micro-batches equal one full batch.

Reference = one forward over all 8 sequences, HF-style mean cross-entropy over every non-ignored
label, and the global balancing loss computed from ``outputs.router_logits`` with plain torch ops.
Under test = ``moeflow.train.trainer.accumulate_gradients`` over 4 micro-batches of 2 sequences of varied
lengths (float64, so 1e-6 relative is a statement about the maths, not about rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model_cfg

from moeflow.data.collate import collate, token_mask
from moeflow.loading.factory import make_model
from moeflow.model.chunked_loss import count_label_tokens, install
from moeflow.model.routing import adapter_or_none
from moeflow.model.settings import ModelSettings
from moeflow.settings import ConfigError, typed
from moeflow.train.losses import (
    LayerRouter,
    StepLoss,
    balance_from_sums,
    expert_counts,
    update_correction_bias,
)
from moeflow.train.settings import BalanceSettings
from moeflow.train.trainer import accumulate_gradients
from moeflow.workflow.load import load

VOCAB = 97
LENGTHS = [23, 9, 31, 17, 12, 28, 5, 20]  # 8 sequences, 4 micro-batches of 2 of varied lengths
COEF = 0.05


def rows_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for doc, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[0] = -100
        rows.append(
            {"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": list(range(n)), "doc_ids": [doc] * n}
        )
    return rows


@pytest.fixture(scope="module")
def model64():
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=7).double()
    model.train()
    return model


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def reference_grads(model, rows, balance: bool):
    """One batch of all rows: HF-style mean CE + (optionally) the global balancing loss, plain torch."""
    model.zero_grad(set_to_none=True)
    batch = collate(rows)
    # one document per row, padded at the end: plain causal attention is exact for the real tokens
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    out = model(**inputs, use_cache=False, output_router_logits=True)
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    if balance:
        real = (batch["doc_ids"] >= 0).reshape(-1)
        k, per_layer = model.config.num_experts_per_tok, []
        for layer_logits in out.router_logits:
            probs = torch.softmax(layer_logits[real], dim=-1)
            chosen = probs.topk(k, dim=-1).indices
            f = torch.bincount(chosen.reshape(-1), minlength=probs.shape[-1]).double() / chosen.numel()
            per_layer.append(probs.shape[-1] * (f * probs.mean(0)).sum())
        loss = loss + COEF * torch.stack(per_layer).mean()
    loss.backward()
    return grads(model)


def balance(**section) -> BalanceSettings:
    """``train.balance`` settings: the keys given, the schema's defaults for the rest."""
    return typed(BalanceSettings, section)


def accumulated_grads(model, rows, mode: str, micro=2):
    model.zero_grad(set_to_none=True)
    batches = [collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]
    settings = balance(mode=mode, coef=COEF if mode != "off" else 0.0)
    step = accumulate_gradients(model, batches, settings, adapter_or_none(model))
    return grads(model), step


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("chunk_tokens", [7, 1024])  # many chunks per micro-batch, and one
def test_cross_entropy_of_accumulated_micro_batches_equals_the_full_batch(model64, chunk_tokens):
    rows = rows_of(LENGTHS)
    reference = reference_grads(model64, rows, balance=False)
    install(model64, chunk_tokens)
    accumulated, step = accumulated_grads(model64, rows, "off")
    assert step.num_label_tokens == sum(n - 1 for n in LENGTHS)
    assert relative(accumulated, reference) < 1e-6


def test_exact_balancing_of_accumulated_micro_batches_equals_the_full_batch(model64):
    rows = rows_of(LENGTHS)
    reference = reference_grads(model64, rows, balance=True)
    accumulated, step = accumulated_grads(model64, rows, "exact")
    assert relative(accumulated, reference) < 1e-6
    # the balancing term matters: without it the gradient is measurably different
    ce_only = reference_grads(model64, rows, balance=False)
    assert relative(ce_only, reference) > 1e-4
    # the step's reported global balancing loss is the sum of the micro-batch shares in exact mode
    assert step.summary()["balance_global"] == pytest.approx(step.totals["balance"], rel=1e-6)


def reference_accumulated_grads(model, rows, mode: str, micro=2):
    """Micro-batch by micro-batch in plain torch: CE summed over the step's label tokens, plus the balancing
    loss of ``mode``: ``running``, f from the counts of the step so far (this micro-batch included) and P
    as a share of the step's tokens; ``micro_batch``, f and P of the micro-batch alone, averaged over the
    step's micro-batches."""
    model.zero_grad(set_to_none=True)
    batches = [collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]
    label_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    routed_tokens = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    running = None
    for batch in batches:
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, output_router_logits=True
        )
        logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
        loss = (
            F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
            / label_tokens
        )
        real = (batch["doc_ids"] >= 0).reshape(-1)
        probs = [torch.softmax(layer_logits[real], dim=-1) for layer_logits in out.router_logits]
        counts = torch.stack(
            [torch.bincount(p.topk(k, dim=-1).indices.reshape(-1), minlength=experts).double() for p in probs]
        )
        running = counts if running is None else running + counts
        if mode == "running":
            f, shares, weight = running / running.sum(-1, keepdim=True), [p.sum(0) / routed_tokens for p in probs], 1.0
        else:
            f, shares, weight = counts / counts.sum(-1, keepdim=True), [p.mean(0) for p in probs], 1.0 / len(batches)
        balance = torch.stack([experts * (f[layer] * share).sum() for layer, share in enumerate(shares)]).mean()
        (loss + COEF * weight * balance).backward()
    return grads(model)


@pytest.mark.parametrize("mode", ["running", "micro_batch"])
def test_running_and_micro_batch_modes_match_their_definitions(model64, mode):
    """Each approximate mode against a hand-written reference of its definition, over 8 accumulation steps."""
    rows = rows_of(LENGTHS * 2, seed=3)  # 16 sequences: 8 accumulation steps of 2
    accumulated, _ = accumulated_grads(model64, rows, mode)
    reference = reference_accumulated_grads(model64, rows, mode)
    assert relative(accumulated, reference) < 1e-6


def test_running_mode_is_closer_to_exact_than_micro_batch(model64):
    """Running mode differs from exact only through the early micro-batches' partial counts."""
    rows = rows_of(LENGTHS * 2, seed=3)
    exact, _ = accumulated_grads(model64, rows, "exact")
    running, _ = accumulated_grads(model64, rows, "running")
    micro, _ = accumulated_grads(model64, rows, "micro_batch")
    ce_only, _ = accumulated_grads(model64, rows, "off")
    # compare the balancing term's own gradient contribution (the CE part is identical in all modes)
    running_gap = relative(running - ce_only, exact - ce_only)
    micro_gap = relative(micro - ce_only, exact - ce_only)
    print(
        f"8 accumulation steps of 2 sequences: balancing-gradient gap to exact: running {running_gap:.3f}, "
        f"micro_batch {micro_gap:.3f}"
    )
    assert 0 < running_gap < micro_gap


def test_label_tokens_are_counted_after_the_shift():
    labels = torch.tensor([[1, 2, -100, 4, 5], [-100, 6, 1, -100, -100]])
    assert count_label_tokens(labels) == 5


def test_token_mask_leaves_out_padding():
    batch = collate(rows_of([5, 3]))
    assert token_mask(batch).sum() == 8 and token_mask(batch).shape == (2, 5)


def test_balancing_loss_is_one_when_balanced_and_n_over_k_when_collapsed():
    uniform = torch.full((2, 4), 10.0, dtype=torch.float64)
    assert float(balance_from_sums(uniform, torch.full((2, 4), 5.0), 20)) == pytest.approx(1.0)
    collapsed = torch.tensor([[40.0, 0, 0, 0]], dtype=torch.float64)
    assert float(balance_from_sums(collapsed, torch.tensor([[40.0, 0, 0, 0]]), 40)) == pytest.approx(4.0)


def test_z_loss_matches_its_definition():
    logits = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    layer = LayerRouter(logits=logits, probs=torch.softmax(logits, -1), topk_index=logits.topk(2).indices)
    step = StepLoss.for_step(balance(mode="off", z_loss_coef=1.0), 6, 6, 1)
    loss = step.micro_batch_loss(torch.zeros((), dtype=torch.float64), [layer])
    assert float(loss) == pytest.approx(float(torch.logsumexp(logits, -1).square().mean()))


def test_the_steps_reported_loss_is_the_sum_of_its_micro_batch_losses():
    """summary()'s ``loss`` (what the Trainer logs and checks for NaN) weighs the terms as the backward pass did:
    cross-entropy, balancing, z-loss and the MTP term."""
    torch.manual_seed(0)
    step = StepLoss.for_step(balance(mode="running", coef=0.3, z_loss_coef=0.2), 10, 12, 2, mtp_weight=0.5)
    total = 0.0
    for tokens in (5, 7):
        logits = torch.randn(tokens, 4, dtype=torch.float64)
        layer = LayerRouter(logits=logits, probs=torch.softmax(logits, -1), topk_index=logits.topk(2).indices)
        ce, mtp = torch.rand((), dtype=torch.float64) * 20, [torch.rand((), dtype=torch.float64) * 20]
        total += float(step.micro_batch_loss(ce, [layer], mtp))
    summary = step.summary()
    assert summary["balance"] > 0 and summary["z_loss"] > 0 and summary["mtp"] > 0
    assert summary["loss"] == pytest.approx(total, rel=1e-12)


def test_exact_mode_without_counts_is_refused():
    with pytest.raises(ValueError, match="counting forward"):
        StepLoss.for_step(balance(mode="exact"), 1, 1, 1)
    with pytest.raises(ConfigError, match="config key 'train.balance.mode': 'global' is not one of the allowed values"):
        load(overrides={"train": {"balance": {"mode": "global"}}})


def test_expert_counts_and_loss_free_bias_update():
    index = torch.tensor([[0, 1], [0, 2], [0, 1]])
    layer = LayerRouter(logits=torch.zeros(3, 4), probs=torch.full((3, 4), 0.25), topk_index=index)
    counts = expert_counts([layer])
    assert counts.tolist() == [[3.0, 2.0, 1.0, 0.0]]
    bias = torch.zeros(4)
    update_correction_bias([bias], counts, rate=0.001)
    # mean load 1.5: overloaded experts go down, underloaded up
    assert bias.tolist() == pytest.approx([-0.001, -0.001, 0.001, 0.001])
