"""A quantized base's fused experts run one expert at a time (moeflow.model.quantized_experts): the outputs and
gradients of transformers' own loop over the whole dequantized tensor with peft's fold of the adapters (in bf16 at
least as close to the fp32 truth), without ever dequantizing more than one expert's rows or keeping a dense weight
for the backward pass.

Three families whose experts differ: qwen3_moe (gate and up stacked), gpt_oss ((experts, in, out) tensors with
biases, its interleaved clamped gate) and step3p5 (its SwiGLU clamps), each a tiny model built from config with
widths that are multiples of 32, quantized to NF4, with LoRA on every target, in fp32 and in bf16 under autocast as
on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import pytest
import torch
from tiny_models import VOCAB, model_config
from tiny_training import settings

from moeflow.loading.factory import Layout, make_model
from moeflow.model import expert_lora
from moeflow.model.quantization import Dequantize
from moeflow.model.quantized_experts import is_expert_wise
from moeflow.model.settings import ModelSettings
from moeflow.settings import typed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes runs on torch 2.4+: the current stack"
)

WIDTHS = {
    "qwen3_moe": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32},
    "gpt_oss": {"hidden_size": 64, "intermediate_size": 32},
    "step3p5": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "share_expert_dim": 32},
}
TOKENS = 37  # no expert weight has a dimension this long, so a saved (tokens, .) tensor is never mistaken for one


def quantized_experts(family: str, precision: str) -> torch.nn.Module:
    """The first MoE layer's experts module of the family's tiny QLoRA model, its adapters' factors made non-zero."""
    section = model_config(family)
    section["config"] |= WIDTHS[family]
    lora = {"rank": 4, "targets": ["all"], "router": "frozen"}
    train = settings(method="lora", gradient_checkpointing=True, lora=lora)
    single = Layout.single("cpu", train)
    layout = Layout(single.ranks, single.parallel, train, precision)
    model = make_model(typed(ModelSettings, {**section, "quantization": "nf4"}), vocab_size=VOCAB, layout=layout)
    module = next(m for m in model.modules() if is_expert_wise(m))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor in expert_lora.adapted_tensors(module):
            for name in expert_lora.factor_names(tensor):
                factor = module._parameters[name]
                factor.copy_(torch.randn(factor.shape, generator=generator) * 0.2)
    return module


def reference(module: torch.nn.Module, *inputs: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """The family's own experts forward (transformers' eager loop) over each whole tensor dequantized, plus its
    adapter's update folded in over all experts at once, as peft's ``_LoraFactorsProxy`` folds it; with ``fp32``, all
    of it in fp32 from the same (bf16) dequantized weights, autocast off: the truth a bf16 run rounds."""
    family = next(c for c in type(module).__mro__ if not c.__name__.startswith(("ExpertWise", "Parametrized")))
    dtype = (lambda t: t.float()) if fp32 else (lambda t: t)
    twin = family.__new__(family)
    twin.__dict__.update(module.__dict__)
    twin._parameters = {n: dtype(p) for n, p in module._parameters.items() if n.endswith("_bias")}
    twin._modules = {n: m for n, m in module._modules.items() if n != "parametrizations"}
    for tensor, (scaling, transposed) in expert_lora.adapted_tensors(module).items():
        chain = module.parametrizations[tensor]
        dense = dtype(chain[0].rows(chain.original))
        a, b = (module._parameters[n].to(dense.dtype) for n in expert_lora.factor_names(tensor))
        lhs, rhs = (a.transpose(-2, -1), b.transpose(-2, -1)) if transposed else (b, a)
        with torch.autocast("cpu", enabled=False):
            object.__setattr__(twin, tensor, torch.baddbmm(dense, lhs, rhs, alpha=scaling))
    with torch.autocast("cpu", enabled=False) if fp32 else contextlib.nullcontext():
        return family.forward(twin, *(dtype(t) if t.is_floating_point() else t for t in inputs))


def run(forward, module, precision: str, seed: int = 0):
    """Output and the gradients of the input and of every adapter factor, for random routing of TOKENS tokens."""
    generator = torch.Generator().manual_seed(seed)
    experts, hidden = module.num_experts, module.hidden_size if hasattr(module, "hidden_size") else module.hidden_dim
    x = torch.randn(TOKENS, hidden, generator=generator).requires_grad_(True)
    index = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, 2, generator=generator)
    factors = [module._parameters[n] for t in expert_lora.adapted_tensors(module) for n in expert_lora.factor_names(t)]
    for factor in factors:
        factor.grad = None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with autocast:
        out = forward(module, x, index, weights)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out.detach().float(), x.grad, *(f.grad for f in factors)]


@pytest.mark.parametrize("family", sorted(WIDTHS))
def test_each_expert_alone_computes_what_the_whole_dequantized_tensor_does(family):
    """In fp32 the same outputs and gradients as transformers' loop over the whole tensors with peft's fold, within
    1e-5. In bf16 under autocast, no further from the fp32 truth than that fold is: the adapter's product is added in
    fp32 beside the weight's, not folded into a bf16 copy of it."""
    module = quantized_experts(family, "fp32")
    assert len(expert_lora.adapted_tensors(module)) == 2  # both tensors adapted, moeflow's factors, not peft's
    got, want = run(type(module).forward, module, "fp32"), run(reference, module, "fp32")
    assert all(g is not None and g.abs().sum() > 0 for g in got)
    for g, w in zip(got, want, strict=True):
        assert error(g, w) < 1e-5
    module = quantized_experts(family, "bf16")
    got, fold = run(type(module).forward, module, "bf16"), run(reference, module, "bf16")
    truth = run(functools.partial(reference, fp32=True), module, "fp32")
    for g, f, t in zip(got, fold, truth, strict=True):
        assert error(g, t) <= max(1.25 * error(f, t), 1e-3), (error(g, t), error(f, t))


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("family", sorted(WIDTHS))
def test_only_one_experts_rows_are_ever_dense_and_none_is_kept_for_the_backward(family, monkeypatch):
    """Every dequantization reads one expert's stored rows (2-D), in the forward and again in the backward; what
    autograd saves holds no dense expert weight (of any orientation)."""
    module = quantized_experts(family, "bf16")
    read = []
    rows = Dequantize.rows
    monkeypatch.setattr(Dequantize, "rows", lambda self, stored: read.append(stored.dim()) or rows(self, stored))
    weights = {tuple(chain[0].packing.shape[1:]) for chain in module.parametrizations.values()}
    weights |= {shape[::-1] for shape in weights}
    saved = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        run(type(module).forward, module, "bf16")
    assert read and set(read) == {2}, read
    assert not weights & set(saved), weights & set(saved)


def test_a_freed_model_takes_its_quantized_experts_with_it():
    """The classes made for an experts module (parametrize's own for that instance, which holds the module) are not
    cached: a cache kept every model's quantized experts alive after the model was gone (106 MiB at the benchmark
    model's shape, found by benchmarks/scale_worker.py's QLoRA resume)."""
    import gc
    import weakref

    quantized_experts("qwen3_moe", "bf16")  # the process's first build: what a one-time warning's record holds
    gc.collect()
    module = quantized_experts("qwen3_moe", "bf16")
    stored = weakref.ref(next(t for t in module.parameters() if t.dtype == torch.uint8))
    gone = weakref.ref(module)
    del module
    gc.collect()
    assert gone() is None and stored() is None
