"""A frozen base held in 4 or 8 bits (``model.quantization``), each weight dequantized when it is read.

QLoRA's base: a LoRA run's frozen weight matrices in bitsandbytes' formats, NF4 or FP4 (two 4-bit codes per byte,
one fp32 scale per block of 64 elements, or 32 where a row is not a multiple of 64) or int8 (one fp32 scale per
row). Every weight matrix of the decoder layers is quantized: attention, dense and shared MLPs and the routed
experts, as ``nn.Linear`` modules (transformers 4.57) or fused 3-D parameters (transformers 5). The embedding, the
norms, the routers, the output layer and the MTP layers (carried frozen into the export) stay in the compute dtype.

Each quantized weight is a parametrization (``torch.nn.utils.parametrize``) of the module that holds it: the stored
tensor (``parametrizations.<name>.original``, uint8) holds each row's codes followed by its scales (:class:`Packing`),
and reading ``module.<name>`` dequantizes it into the compute dtype (:class:`Dequantize`). So the module's own
forward, transformers' fused-experts kernels and peft's adapters read a dense weight, made when it is read and
dropped after (peft's ``ParamWrapper`` chains its LoRA update after the dequantization and removes only its own). A
row's blocks never straddle two rows, so the stored tensor is cut along its first dimension like the weight: FSDP2
shards it with the rest of a decoder layer, and each rank quantizes the rows it reads (moeflow.parallel.rank_load).
Activation checkpointing is required (the config check): without it autograd keeps every layer's dequantized weight
for the backward pass, a dense copy of the model.

The kernels are bitsandbytes' (``quantize_4bit``/``dequantize_4bit``, ``int8_vectorwise_quant``/``_dequant``), which
need torch 2.4 or newer: the current stack; imported when a weight is packed or read. The formats' sizes, which the
planner counts, are moeflow.model.settings'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.model.parameters import base_name, clean_name
from moeflow.model.quantized_experts import run_expert_wise
from moeflow.model.settings import QUANTIZATION_BLOCK, QUANTIZED_BITS
from moeflow.model.wrappers import unwrap

BITS, BLOCK = QUANTIZED_BITS, QUANTIZATION_BLOCK  # a 4-bit block: 32 where a row is not a multiple of 64


class QuantizationError(ValueError):
    """A weight moeflow cannot quantize as asked, naming it and what to do."""


def block_size(kind: str, width: int, name: str = "a weight") -> int:
    """Elements per scale of a row ``width`` wide: the whole row for int8; for 4 bits a block that divides the row."""
    if kind == "int8":
        return width
    for block in (BLOCK, BLOCK // 2):
        if width % block == 0:
            return block
    raise QuantizationError(
        f"model.quantization: {kind} quantizes each row of a weight in blocks of {BLOCK} (or {BLOCK // 2}) elements, "
        f"and {name}'s rows are {width} wide: use a model whose widths are multiples of 32, or model.quantization: "
        "int8 (one scale per row)"
    )


@dataclass(frozen=True)
class Packing:
    """How a dense weight of ``shape`` is stored in ``kind``: each row's codes, then its fp32 scales as bytes, in one
    uint8 tensor of the weight's leading dimensions (so cutting its rows cuts whole blocks)."""

    kind: str
    shape: tuple[int, ...]
    block: int

    @property
    def code_bytes(self) -> int:
        return self.shape[-1] * BITS[self.kind] // 8

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.code_bytes + 4 * (self.shape[-1] // self.block))


def pack(kind: str, dense: torch.Tensor, block: int) -> torch.Tensor:
    """``dense`` (any leading dimensions; its rows quantized block by block) as :class:`Packing` stores it. int8 is
    bitsandbytes' vector-wise rounding (each row to 127 steps of its largest magnitude) in plain torch: its CUDA
    kernel takes float16 only, which overflows a bf16 weight above 65,504."""
    import bitsandbytes.functional as F

    rows = (*dense.shape[:-1], -1)
    if kind == "int8":
        flat = dense.reshape(-1, dense.shape[-1]).float()
        scales = flat.abs().amax(dim=1)
        codes = torch.round(flat * (127 / scales.clamp_min(torch.finfo(torch.float32).tiny))[:, None]).to(torch.int8)
    else:
        codes, state = F.quantize_4bit(dense.contiguous(), blocksize=block, quant_type=kind, compress_statistics=False)
        scales = state.absmax
    scales = scales.float().contiguous().view(torch.uint8)
    return torch.cat([codes.view(torch.uint8).reshape(rows), scales.reshape(rows)], -1)


def unpack(packing: Packing, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of :func:`pack`'s bytes (of a shard of its rows too: any leading shape), in ``dtype``."""
    import bitsandbytes.functional as F

    shape = (*stored.shape[:-1], packing.shape[-1])
    codes = stored[..., : packing.code_bytes].contiguous()
    scales = stored[..., packing.code_bytes :].contiguous().view(torch.float32).reshape(-1)
    if packing.kind == "int8":
        rows = codes.view(torch.int8).reshape(-1, shape[-1]).float() * (scales / 127)[:, None]
        return rows.view(shape).to(dtype)
    state = F.QuantState(
        absmax=scales,
        shape=torch.Size(shape),
        code=_code_table(packing.kind, stored.device),
        blocksize=packing.block,
        quant_type=packing.kind,
        dtype=dtype,
    )
    return F.dequantize_4bit(codes.reshape(-1, 1), state)


@functools.cache
def _code_table(kind: str, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16 values of a 4-bit format on ``device``: made once, not copied to a GPU at every read (a read
    per expert and projection, in the forward, its recomputation and the backward)."""
    import bitsandbytes.functional as F

    return F.get_4bit_type(kind, device=device)


class Dequantize(torch.nn.Module):
    """A weight's parametrization: the stored tensor (``original``: :func:`pack`'s bytes) read as the dense weight in
    :attr:`dtype` (on the meta device, an empty one of its shape)."""

    def __init__(self, packing: Packing, dtype: torch.dtype):
        super().__init__()
        self.packing, self.dtype = packing, dtype

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        if stored.is_meta:
            return torch.empty(self.packing.shape, dtype=self.dtype, device="meta")
        return self.rows(stored)

    def rows(self, stored: torch.Tensor) -> torch.Tensor:
        """Some of the weight's rows (one expert's of a fused tensor, say), dense, from their stored bytes."""
        return unpack(self.packing, stored, self.dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight: its name in the base model, the module holding it and the parametrization's name there."""

    name: str
    module: torch.nn.Module
    attribute: str

    @property
    def dequantize(self) -> Dequantize:
        return self.module.parametrizations[self.attribute][0]

    @property
    def stored(self) -> torch.nn.Parameter:
        return self.module.parametrizations[self.attribute].original


def quantize_base(model: Any, kind: str, routers: set[str]) -> list[QuantizedWeight]:
    """Put the decoder layers' weight matrices of a transformers causal LM (not yet wrapped by peft or FSDP) in
    ``kind``: every ``nn.Linear`` weight and every fused 3-D expert parameter, except the modules named in
    ``routers`` (moeflow.model.lora.router_modules) and the MTP layers. A weight on the meta device gets empty
    storage (moeflow.parallel.rank_load fills it). Returns them in module order."""
    from torch.nn.utils import parametrize

    base = unwrap(model, peft=True)
    mtp = mtp_prefixes(base)
    layers = base.get_decoder().layers
    prefix = next(name for name, module in base.named_modules() if module is layers)
    weights = []
    for index, layer in enumerate(layers):
        if is_mtp_name(f"{prefix}.{index}.", mtp):  # carried frozen into the export as they are
            continue
        for path, module in layer.named_modules():
            qualified = f"{prefix}.{index}.{path}" if path else f"{prefix}.{index}"
            if qualified in routers:
                continue
            for attribute, param in list(module.named_parameters(recurse=False)):
                if not _quantized_here(module, attribute, param):
                    continue
                name = f"{qualified}.{attribute}"
                packing = Packing(kind, tuple(param.shape), block_size(kind, param.shape[-1], name))
                if param.is_meta:
                    stored = torch.empty(packing.stored_shape, dtype=torch.uint8, device="meta")
                else:
                    stored = pack(kind, param.detach(), packing.block)
                # the stored bytes become the parameter, read through the parametrization (which has no inverse)
                module._parameters[attribute] = torch.nn.Parameter(stored, requires_grad=False)
                parametrize.register_parametrization(module, attribute, Dequantize(packing, param.dtype), unsafe=True)
                weights.append(QuantizedWeight(name, module, attribute))
                if param.dim() == 3 and hasattr(module, "has_gate"):  # transformers' experts: one at a time
                    run_expert_wise(module)
    if not weights:
        raise QuantizationError(f"model.quantization: {kind}: {type(base).__name__} has no weight matrix to quantize")
    return weights


def _quantized_here(module: torch.nn.Module, attribute: str, param: torch.Tensor) -> bool:
    if isinstance(module, torch.nn.Linear):
        return attribute == "weight"
    return param.dim() == 3 and param.is_floating_point()  # fused experts (transformers 5): (experts, ., .)


def quantized_weights(model: Any) -> dict[str, QuantizedWeight]:
    """The quantized weights of a model (:func:`quantize_base`'s), by their name in the base model (also under peft's
    wrappers and FSDP's)."""
    found = {}
    for path, module in unwrap(model, peft=True).named_modules():
        for attribute, chain in getattr(module, "parametrizations", {}).items():
            if chain and isinstance(chain[0], Dequantize):
                name = base_name(clean_name(f"{path}.{attribute}" if path else attribute))
                found[name] = QuantizedWeight(name, module, attribute)
    return found
