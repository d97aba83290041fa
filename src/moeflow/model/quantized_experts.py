"""Fused experts over a quantized base, run one expert at a time, so that only the running expert's weights are dense.

Reading a quantized fused tensor (``module.gate_up_proj``, moeflow.model.quantization) dequantizes every expert of
the layer at once, and autograd keeps what each expert's matmul read until the layer's backward: a dense copy of the
layer's experts, and with peft's adapter a second one with the update folded in (for Step-3.5-Flash's 288 experts,
about 14 GiB in bf16). Here each expert's projection is :class:`_ExpertProjection`. It dequantizes that expert's rows
only (a slice of the stored bytes: the packing cuts by rows) and multiplies; the expert's adapter (moeflow.model
.expert_lora's factors) adds its low-rank product beside it in fp32, as peft's LoRA layers do over a bitsandbytes
``Linear4bit``, rather than fold its update into a bf16 copy of the weight, which would round a small update away.
For its backward it keeps only the input, the stored slice, the factors and the rank-r intermediate, and dequantizes
again there, as bitsandbytes' ``MatMul4Bit`` does.

:func:`expert_wise_forward` is transformers' eager per-expert loop, written over the attributes its
``use_experts_implementation`` gives every experts class (``has_gate``, ``has_bias``, ``is_transposed``,
``_apply_gate``, ``act_fn``, ``has_post_expert_norm``). So one forward serves every family, whatever
``model.experts_implementation`` says: a quantized base's experts always run this loop.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moeflow.model import expert_lora


def run_expert_wise(module: torch.nn.Module) -> None:
    """Make a fused experts module whose 3-D tensors are quantized run :func:`expert_wise_forward`."""
    if not isinstance(module, _ExpertWise):
        module.__class__ = _expert_wise_class(type(module))


def is_expert_wise(module: torch.nn.Module) -> bool:
    return isinstance(module, _ExpertWise)


def split_quantized_experts(model: torch.nn.Module, ep_size: int) -> None:
    """Before transformers' expert parallelism splits a quantized experts module's stored bytes by experts (their
    names in its plan: moeflow.model.expert_lora.ep_plan), give the module the count of experts each rank holds.
    transformers sets it only when it splits a tensor of the module's own, and reads it when it installs the
    module's token dispatch, which comes before it splits the stored bytes (a submodule's): a count left global
    there sends every token to the first rank. Not read from a split tensor, whose rows FSDP may cut further."""
    for module in model.modules():
        if is_expert_wise(module):
            experts = next(iter(module.parametrizations.values()))[0].packing.shape[0]
            module.num_experts = experts // ep_size
            module._is_expert_parallel = True


class _ExpertWise:
    """Marks the classes :func:`run_expert_wise` makes."""


def _expert_wise_class(cls: type) -> type:
    """Made for each module, never cached: a quantized module's class is torch.nn.utils.parametrize's own for that
    instance, whose properties hold the module, so a cache keyed by it would keep every model's weights alive."""
    return type(f"ExpertWise{cls.__name__}", (cls, _ExpertWise), {"forward": expert_wise_forward})


def expert_wise_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts loop (``Qwen3MoeExperts.forward``; GPT-OSS's with its biases and transposed
    tensors), each projection an :class:`_ExpertProjection`. An index of ``num_experts`` or more (expert
    parallelism's marker for a token whose expert is on another rank) is skipped."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask[: self.num_experts].sum(dim=(-1, -2)), 0).nonzero()
    project = _projections(self)
    first = "gate_up_proj" if self.has_gate else "up_proj"
    for expert in hit[:, 0].tolist():
        top_k_pos, token_idx = torch.where(mask[expert])
        current = project[first](expert, hidden_states[token_idx])
        current = self._apply_gate(current) if self.has_gate else self.act_fn(current)
        current = project["down_proj"](expert, current)
        if self.has_post_expert_norm:
            current = self.post_expert_norm(current)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def _projections(module: torch.nn.Module) -> dict[str, functools.partial]:
    """Each quantized tensor's projection of one expert's tokens, ``(expert, x) -> out``. Its adapter's factors are
    cut into experts once a forward (``unbind``: one gradient for all the experts, not a whole factor's each)."""
    out = {}
    for tensor, chain in module.parametrizations.items():
        stored = chain.original
        if type(stored).__name__ == "DTensor":  # split by experts (ep): this rank's rows, which its forward gets
            stored = stored.to_local()
        a = b = None
        scaling = 0.0
        adapted = expert_lora.adapted_tensors(module).get(tensor)
        if adapted is not None:
            a, b = (module._parameters[name].unbind(0) for name in expert_lora.factor_names(tensor))
            scaling = adapted[0]
        bias = getattr(module, f"{tensor}_bias") if module.has_bias else None
        transposed = bool(module.is_transposed)
        out[tensor] = functools.partial(_project, stored, chain[0], a, b, scaling, transposed, bias)
    return out


def _project(stored, dequantize, a, b, scaling, transposed, bias, expert: int, x: torch.Tensor) -> torch.Tensor:
    a, b = (None, None) if a is None else (a[expert], b[expert])
    out = _ExpertProjection.apply(x, stored[expert], a, b, dequantize, scaling, transposed)
    return out if bias is None else out + bias[expert]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes in here: autocast's where it is on (it casts both operands), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _ExpertProjection(torch.autograd.Function):
    """One expert's ``x W^T`` (``x W`` for an (in, out) tensor), ``W`` its dequantized rows, plus its adapter's
    ``scaling x A^T B^T`` (``a``: (r, in), ``b``: (out, r), fp32) computed in fp32 beside it, as peft's LoRA layers add
    theirs to a quantized ``Linear4bit``'s output. The backward dequantizes ``W`` again rather than keep it."""

    @staticmethod
    def forward(ctx, x, stored, a, b, dequantize, scaling, transposed):
        compute = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            weight = dequantize.rows(stored).to(compute)
            out = x.to(compute) @ weight if transposed else F.linear(x.to(compute), weight)
            low = None
            if a is not None:
                low = x.float() @ a.float().T
                out = out + (scaling * (low @ b.float().T)).to(compute)
        ctx.save_for_backward(x, stored, a, b, low)
        ctx.dequantize, ctx.scaling, ctx.transposed, ctx.compute = dequantize, scaling, transposed, compute
        return out

    @staticmethod
    def backward(ctx, grad):
        x, stored, a, b, low = ctx.saved_tensors
        grad_x = grad_a = grad_b = None
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(ctx.compute)
            grad_low = grad.float() @ b.float() if a is not None else None  # (tokens, r)
            if ctx.needs_input_grad[0]:
                weight = ctx.dequantize.rows(stored).to(ctx.compute)
                grad_x = grad @ weight.T if ctx.transposed else grad @ weight
                if a is not None:
                    grad_x = grad_x.float() + ctx.scaling * (grad_low @ a.float())
                grad_x = grad_x.to(x.dtype)
            if a is not None and ctx.needs_input_grad[2]:
                grad_a = (ctx.scaling * (grad_low.T @ x.float())).to(a.dtype)
            if a is not None and ctx.needs_input_grad[3]:
                grad_b = (ctx.scaling * (grad.float().T @ low)).to(b.dtype)
        return grad_x, None, grad_a, grad_b, None, None, None
