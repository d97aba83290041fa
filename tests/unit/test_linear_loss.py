"""The chunked linear cross-entropy against F.cross_entropy on the full logits (float64: 1e-6 relative is a
statement about the maths), and the claim that the full logits and their gradient never exist."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checks import dtype_for, tolerance
from tiny_models import FAMILIES, TRANSFORMERS_5_ONLY, VOCAB, build_family, tiny_model_cfg
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.data.collate import collate, model_inputs
from moeflow.loading.factory import make_model
from moeflow.model.chunked_loss import LinearLossError, install, linear_cross_entropy, next_token_targets, token_losses
from moeflow.model.lora import apply_lora
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.settings import TrainSettings

IGNORE = -100


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def problem(n=41, h=8, v=53, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::4] = IGNORE
    return hidden, weight, b, targets


def gradients(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_tokens", [1, 6, 41, 4096])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.125])  # Granite divides its logits by logits_scaling
def test_loss_and_gradients_equal_full_logits_cross_entropy(chunk_tokens, bias, scale):
    hidden, weight, b, targets = problem(bias=bias)
    loss, token_loss = linear_cross_entropy(hidden, weight, targets, bias=b, chunk_tokens=chunk_tokens, scale=scale)
    logits = F.linear(hidden, weight, b) * scale
    reference = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    assert relative(loss, reference) < 1e-6
    per_token = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    assert relative(token_loss, per_token) < 1e-6 and not token_loss.requires_grad
    # a non-unit upstream gradient (the step's 1 / label tokens) scales every gradient
    for ours, theirs in zip(gradients(loss / 37, (hidden, weight, b)), gradients(reference / 37, (hidden, weight, b))):
        assert relative(ours, theirs) < 1e-6


def test_without_grad_only_losses_are_computed():
    hidden, weight, _, targets = problem()
    with torch.no_grad():
        loss, token_loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=5)
    reference = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE, reduction="sum")
    assert not loss.requires_grad and relative(loss, reference) < 1e-6
    assert float(token_loss[targets == IGNORE].abs().sum()) == 0.0


def test_bf16_autocast_runs_the_products_in_bf16_and_keeps_the_loss_in_fp32():
    hidden, weight, _, targets = problem()
    hidden32, weight32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = linear_cross_entropy(hidden32, weight32, targets, chunk_tokens=8)
    loss.backward()
    reference = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE, reduction="sum")
    assert loss.dtype == torch.float32 and relative(loss.double(), reference) < 2e-2
    assert hidden32.grad.dtype == torch.float32 and weight32.grad.dtype == torch.float32


class LargestTensors(TorchDispatchMode):
    """Records the shape of every tensor an operator returns that has a dimension of ``size``."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.shapes = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.size in t.shape:
                self.shapes.append(tuple(t.shape))
        return out

    def largest(self) -> int:
        return max((torch.Size(s).numel() for s in self.shapes), default=0)


def packed_batch(rows=2, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids, "position_ids": list(range(length)), "doc_ids": [r] * length})
    return collate(out)


def test_neither_the_full_logits_nor_their_gradient_are_ever_built():
    """A training forward and backward through the model: no tensor with a vocabulary dimension holds more
    than one chunk's rows. The model's own forward (the planted bug) builds (B, L, vocab)."""
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=0).train()
    batch = packed_batch()
    tokens = batch["input_ids"].numel()
    install(model, chunk_tokens=16)
    with LargestTensors(VOCAB) as seen:
        token_losses(model, model_inputs(model, batch), batch["labels"]).loss.backward()
    assert seen.shapes, "the output layer's weight has a vocabulary dimension: the recorder must see it"
    weight_numel = model.get_output_embeddings().weight.numel()
    assert seen.largest() <= max(16 * VOCAB, weight_numel) < tokens * VOCAB
    with LargestTensors(VOCAB) as seen:
        model(**model_inputs(model, batch), use_cache=False).logits.float().sum().backward()
    assert seen.largest() >= tokens * VOCAB


CAUSAL_LM_FAMILIES = [  # step3p5: transformers 5 only
    pytest.param(f, marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="transformers 5 only"))
    if f in TRANSFORMERS_5_ONLY
    else f
    for f in FAMILIES
]


@pytest.mark.parametrize("family", CAUSAL_LM_FAMILIES)
def test_every_family_matches_its_own_logits(family):
    """Tied and untied embeddings, Granite's logit scaling, gpt_oss's sinks and biases: the installed
    loss equals cross-entropy on the model's own logits, and so do all parameter gradients."""
    model = build_family(family, dtype=dtype_for(family)).train()
    tol = tolerance(dtype_for(family))
    batch = packed_batch(length=24)
    inputs = model_inputs(model, batch)
    install(model, chunk_tokens=10)
    params = [p for p in model.parameters() if p.requires_grad]
    ours = token_losses(model, inputs, batch["labels"]).loss
    ours_grads = torch.autograd.grad(ours, params, allow_unused=True)
    logits = model(**inputs, use_cache=False).logits
    targets = next_token_targets(batch["labels"])
    reference = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    reference_grads = torch.autograd.grad(reference, params, allow_unused=True)
    assert relative(ours, reference) < tol
    for a, b in zip(ours_grads, reference_grads):
        assert (a is None) == (b is None)
        if b is not None and b.norm() > 0:
            assert relative(a, b) < tol


def test_lora_adapters_get_the_gradients_of_the_full_logits_loss():
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=0).double()
    train = typed(TrainSettings, {"steps": 1, "lr": 1e-3, "method": "lora", "lora": {"dropout": 0.0}})
    model = apply_lora(model, train.lora, train.gradient_checkpointing).train()
    with torch.no_grad():  # B starts at zero, which would leave A without gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = packed_batch(length=24)
    inputs = model_inputs(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    install(model, chunk_tokens=7)
    ours = torch.autograd.grad(token_losses(model, inputs, batch["labels"]).loss, params)
    logits = model(**inputs, use_cache=False).logits
    reference = F.cross_entropy(
        logits.reshape(-1, VOCAB), next_token_targets(batch["labels"]).reshape(-1), reduction="sum"
    )
    for a, b in zip(ours, torch.autograd.grad(reference, params)):
        assert relative(a, b) < 1e-6


def test_a_model_without_the_entry_is_named_and_softcapping_is_refused():
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_cfg()
    bare = AutoModelForCausalLM.from_config(
        make_model(typed(ModelSettings, cfg), vocab_size=VOCAB).config,
        **({"experts_implementation": "eager"} if compat.is_transformers_v5() else {}),
    )
    batch = packed_batch(length=8)
    with pytest.raises(LinearLossError, match="install"):
        token_losses(bare, model_inputs(bare, batch), batch["labels"])
    bare.config.final_logit_softcapping = 30.0
    with pytest.raises(LinearLossError, match="final_logit_softcapping"):
        install(bare, 16)


def test_generation_keeps_the_models_own_forward():
    model = make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=0).eval()
    ids = torch.tensor([[5, 6, 7]])
    plain = model(input_ids=ids, use_cache=False).logits
    assert plain.shape == (1, 3, VOCAB)
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
