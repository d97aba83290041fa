"""Next-token cross-entropy from the hidden states by chunks of tokens, never the full logits.

Next-token cross-entropy straight from the decoder's hidden states and the output layer, by chunks of
tokens: the (tokens, vocab) logits never exist whole, nor does their gradient.

At a real vocabulary the loss sets peak memory: 2 x 2,048 tokens at 151,936 entries are 2.5 GB of fp32
logits, and the log-softmax and the logits' gradient take as much again. Here the output layer is applied
to ``chunk_tokens`` rows at a time. In a forward pass that needs gradients each chunk's gradient
(``softmax - one_hot``) is turned into the chunk's share of the hidden states' and the output weight's
gradients at once, so the backward pass only scales them by the upstream gradient: three matrix products
per chunk, as with the full logits, and at most one chunk of logits alive. The loss is a plain sum over
the non-ignored next-token targets, so the gradients are exact (moeflow.train.losses divides by the step's
token count), the same in every chunking up to float rounding.

The model's own forward would compute the full logits, so :func:`install` gives a causal LM a second
entry: called with ``loss_labels`` it runs the decoder body (``model.base_model``), then this loss
(:class:`TokenLosses`); with ``decoder_only=True`` the decoder body alone (:func:`decoder_forward`: the
routing-only passes, which read the routers and need no output layer, ~10% of a real model's forward FLOPs);
without either, it is the model's forward unchanged (generation, tests). It patches
the instance, not the class, inside any FSDP or PEFT wrapper, so the wrapper's forward (FSDP's
parameter gathering) still surrounds the head: the output weight is whole while the loss uses it.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from moeflow.data.shards import IGNORE_INDEX
from moeflow.model.wrappers import unwrap
from moeflow.runtime.host_copies import to_device

LOSS_KWARG = "loss_labels"  # the installed forward's keyword: labels as in the batch (unshifted)
DECODER_KWARG = "decoder_only"  # the installed forward's keyword for the decoder body alone (no output layer)
HIDDEN_KWARG = "keep_hidden"  # the installed forward's keyword to return the hidden state with the loss (MTP)


class LinearLossError(ValueError):
    """A model whose output layer this loss cannot reproduce exactly."""


@dataclass
class TokenLosses(ModelOutput):
    """What the installed forward returns: ``loss`` the summed cross-entropy (with gradient), ``token_loss``
    (B, L) each position's loss of predicting the next token (0 where it has no label; no gradient),
    ``token_greedy`` (B, L) whether that next token is the output layer's top choice (argmax: of tied logits the
    lowest token id; False where there is no label; in a forward without gradients only, else None), and
    with ``keep_hidden`` the decoder's output the loss was computed from (what the MTP loss continues from; else
    None, so that it is freed after the forward as before). A
    ModelOutput, so FSDP finds the tensors in it (it hooks the backward pass on a forward's outputs)."""

    loss: torch.Tensor | None = None
    token_loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    token_greedy: torch.Tensor | None = None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses and gradient sums are kept in float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _chunks(hidden, weight, bias, targets, chunk_tokens: int, scale: float, grads=(False, False, False)):
    """The per-token losses, whether each target is the top logit, and the gradients of the losses' sum with
    respect to hidden, weight and bias where ``grads`` asks for them (in the accumulation dtype; None
    otherwise), one chunk of rows at a time. A frozen output layer (LoRA) costs no weight-gradient product or
    buffer."""
    acc = accumulation_dtype(hidden.dtype)
    n = hidden.shape[0]

    def zeros_if(wanted: bool, like: torch.Tensor | None):
        return torch.zeros(like.shape, dtype=acc, device=like.device) if wanted and like is not None else None

    token_loss = torch.zeros(n, dtype=acc, device=hidden.device)
    token_greedy = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    grad_hidden, grad_weight, grad_bias = (zeros_if(g, t) for g, t in zip(grads, (hidden, weight, bias)))
    for start in range(0, n, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n))
        h, t = hidden[rows], targets[rows]
        z = F.linear(h, weight, bias).to(acc)
        if scale != 1.0:
            z.mul_(scale)
        valid = t != IGNORE_INDEX
        safe = torch.where(valid, t, 0).unsqueeze(1)
        target = z.gather(1, safe).squeeze(1)
        # log-sum-exp and softmax in place of the logits, one exp per entry and no chunk-sized temporary
        token_greedy[rows] = valid & (z.argmax(dim=-1) == t)  # the first of tied maxima, as lm-eval's argmax
        top = z.amax(dim=-1, keepdim=True)
        exp_sum = z.sub_(top).exp_().sum(dim=-1, keepdim=True)
        token_loss[rows] = torch.where(valid, (top + exp_sum.log()).squeeze(1) - target, 0)
        if not any(grads):
            continue
        g = z.div_(exp_sum)  # the softmax
        g.scatter_add_(1, safe, -valid.to(acc).unsqueeze(1))
        g.mul_(valid.to(acc).unsqueeze(1) * scale)  # d(sum of losses)/d(logits before scaling)
        g = g.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = g @ weight
        if grad_weight is not None and g.dtype == acc:
            grad_weight.addmm_(g.t(), h)
        elif grad_weight is not None:
            grad_weight += g.t() @ h  # the product in the compute dtype, summed over chunks in float32
        if grad_bias is not None:
            grad_bias += g.sum(0).to(acc)
        del z, g
    return token_loss, token_greedy, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, scale):
        token_loss, _, grad_hidden, grad_weight, grad_bias = _chunks(
            hidden, weight, bias, targets, chunk_tokens, scale, grads=ctx.needs_input_grad[:3]
        )
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(token_loss)
        return token_loss.sum(), token_loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_token_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        out = [None] * 6
        for i, (grad, dtype) in enumerate(zip((grad_hidden, grad_weight, grad_bias), ctx.dtypes)):
            if grad is not None:
                out[i] = (grad * grad_loss.to(grad.dtype)).to(dtype)
        return tuple(out)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast compute dtype in effect on ``device_type``, or None (torch 2.3 and 2.13 spell it apart)."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of ``scale * (hidden @ weight.T + bias)`` against ``targets`` (IGNORE_INDEX
    rows count nothing) and the per-row losses, computed ``chunk_tokens`` rows at a time.

    ``hidden`` (N, H), ``weight`` (V, H), ``targets`` (N,). Under autocast the products run in its dtype
    (as the output layer would); losses and gradient sums are float32 at least."""
    return _linear_losses(hidden, weight, targets, chunk_tokens, bias, scale)[:2]


def _linear_losses(hidden, weight, targets, chunk_tokens: int, bias, scale: float):
    """:func:`linear_cross_entropy` and, without gradients, each row's greedy flag (else None)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    compute = _autocast_dtype(hidden.device.type)
    if compute is not None:
        hidden, weight = hidden.to(compute), weight.to(compute)
        bias = None if bias is None else bias.to(compute)
    else:
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    targets = to_device(targets, hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        if needs_grad:
            return (*_LinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk_tokens), float(scale)), None)
        token_loss, token_greedy = _chunks(hidden, weight, bias, targets, int(chunk_tokens), float(scale))[:2]
        return token_loss.sum(), token_loss, token_greedy


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t's target, token t+1's label (the last position gets IGNORE_INDEX), in the labels' shape:
    the targets are shifted instead of the hidden states, so nothing of size (B, L, H) is sliced (a copy in
    the forward and a zero-padded gradient in the backward)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_label_tokens(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def logit_scale(config) -> float:
    """The factor the family applies to its logits after the output layer (Granite divides by
    ``logits_scaling``); a transform this loss does not reproduce is refused."""
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        raise LinearLossError(
            f"{config.model_type}: final_logit_softcapping={softcap} is not supported by moeflow's chunked "
            "cross-entropy; use a model without logit soft-capping"
        )
    return 1.0 / float(getattr(config, "logits_scaling", 1.0) or 1.0)


HEAD_ONLY_KWARGS = ("labels", "logits_to_keep", "num_items_in_batch")  # the causal LM's, not the decoder body's


def _loss_forward(self, loss_labels: torch.Tensor, chunk_tokens: int, kwargs: dict, keep_hidden: bool) -> TokenLosses:
    for name in HEAD_ONLY_KWARGS:
        if kwargs.pop(name, None) is not None:
            raise TypeError(f"{name} cannot be combined with {LOSS_KWARG}")
    hidden = self.base_model(**kwargs).last_hidden_state
    head = self.get_output_embeddings()
    targets = next_token_targets(to_device(loss_labels, hidden.device))  # pinned, non-blocking from the host
    loss, token_loss, token_greedy = _linear_losses(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        targets.reshape(-1),
        chunk_tokens,
        head.bias,
        logit_scale(self.config),
    )
    kept = hidden if keep_hidden else None
    greedy = None if token_greedy is None else token_greedy.view(targets.shape)
    return TokenLosses(
        loss=loss, token_loss=token_loss.view(targets.shape), last_hidden_state=kept, token_greedy=greedy
    )


def install(model: torch.nn.Module, chunk_tokens: int) -> torch.nn.Module:
    """Give ``model`` (a causal LM, or an FSDP/PEFT wrapper of one) the ``loss_labels`` entry; returns it.
    Calling it again changes the chunk size."""
    lm = unwrap(model, peft=True)
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise LinearLossError(
            f"{type(lm).__name__}: the output layer is a {type(head).__name__}, not a Linear; moeflow's "
            "chunked cross-entropy applies the output weight itself"
        )
    logit_scale(lm.config)
    original = type(lm).forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        labels = kwargs.pop(LOSS_KWARG, None)
        keep_hidden = kwargs.pop(HIDDEN_KWARG, False)
        if kwargs.pop(DECODER_KWARG, False):
            if labels is not None or args or any(kwargs.get(name) is not None for name in HEAD_ONLY_KWARGS):
                raise TypeError(f"{DECODER_KWARG} runs the decoder body alone: pass the inputs by keyword, no labels")
            return self.base_model(**kwargs)
        if labels is None:
            return original(self, *args, **kwargs)
        if args:
            raise TypeError(f"pass the inputs by keyword with {LOSS_KWARG}")
        return _loss_forward(self, labels, chunk_tokens, kwargs, keep_hidden)

    lm.forward = types.MethodType(forward, lm)
    lm.loss_chunk_tokens = int(chunk_tokens)
    return model


def installed(model: torch.nn.Module) -> bool:
    return hasattr(unwrap(model, peft=True), "loss_chunk_tokens")


def token_losses(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, keep_hidden: bool = False) -> TokenLosses:
    """The model's forward on ``inputs`` (``use_cache=False``) with the chunked loss on ``labels``; with
    ``keep_hidden`` also the decoder's last hidden state."""
    if not installed(model):
        raise LinearLossError(
            "this model has no chunked cross-entropy entry: build or load it with moeflow.loading.factory.make_model, "
            "or call moeflow.model.chunked_loss.install(model, chunk_tokens) first"
        )
    return model(**inputs, use_cache=False, **{LOSS_KWARG: labels, HIDDEN_KWARG: keep_hidden})


def decoder_forward(model: torch.nn.Module, inputs: dict) -> ModelOutput:
    """The decoder body's forward on ``inputs`` (``use_cache=False``), through the model itself (so FSDP's
    and PEFT's wrappers, and moeflow.model.routing's capture, see a forward of the model), without the output
    layer: for the passes that only read the routers (the exact balance mode's counting forward, the coverage
    pool pass, the warmup gate's base reference)."""
    if not installed(model):
        raise LinearLossError(
            "this model has no decoder-only entry: build or load it with moeflow.loading.factory.make_model, "
            "or call moeflow.model.chunked_loss.install(model, chunk_tokens) first"
        )
    return model(**inputs, use_cache=False, **{DECODER_KWARG: True})
