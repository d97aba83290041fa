"""Adapters that load on either stack: routed-expert adapters converted between fused and per-expert layouts.

The conversion is exact, between transformers 5's fused expert tensors and transformers 4.57's per-expert modules.

transformers 5 holds a layer's routed experts as fused 3-D tensors (``mlp.experts.gate_up_proj``, (experts,
2 x ffn, hidden), and ``down_proj``); transformers 4.57, like every published checkpoint, has one module per expert
and projection (``mlp.experts.<e>.gate_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1``). peft adapts the
first with one rank-r adapter per expert over the fused tensor (moeflow.model.expert_lora.peft_factors' layout), the
second with one adapter per module. A bare ``PeftModel.from_pretrained`` of an adapter saved on the other stack
attaches none of its expert adapters, and says nothing. moeflow.model.lora.load_adapter converts:

- fused -> per-expert (saved on transformers 5, loaded on 4.57): each module gets its expert's ``lora_A`` and the rows
  of its expert's ``lora_B`` that its weight is in the fused tensor. Rank r, exact.
- per-expert -> fused (saved on 4.57, loaded on 5): the pieces of one expert's fused tensor (its gate and up
  modules) become one adapter, their ``lora_A`` stacked and their ``lora_B`` block-diagonal: rank 2r with alpha
  2 x alpha (the same alpha / r), as peft converts Mixtral's. Where every expert's pieces share their ``lora_A`` (an
  adapter that was fused before) it stays rank r. Exact either way.

Which rows of which module a fused tensor's rows are is what ``save_pretrained`` writes (moeflow.model.saved_names),
which transformers 5 computes: a loader there computes it from its model, and an adapter saved there records it
(:data:`PIECES_FILE`) for a reader on 4.57. A trainable router's weights are saved under the files' names
(:func:`file_names`), which both stacks read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeflow.model import expert_lora
from moeflow.model import parameters as P
from moeflow.model.quantization import quantized_weights
from moeflow.model.saved_names import saved_format
from moeflow.runtime.files import read_json, write_json

PIECES_FILE = "experts_in_files.json"


ADAPTER_NAME = "default"  # the one peft adapter of a moeflow model


PER_EXPERT_MODULE = re.compile(r"\.experts\.\d+\.")  # an adapter key of one expert's module (4.57's layout)


PEFT_PREFIX = "base_model.model."  # an adapter file's keys: the peft model's names without the adapter name


class AdapterLayoutError(ValueError):
    """An adapter whose routed experts cannot be placed on this model, naming the tensors."""


@dataclass(frozen=True)
class Piece:
    """One module's share of a fused expert tensor: rows ``first_row`` to ``first_row + rows`` of expert
    ``expert``'s slice, the weight of ``module`` (a base-model path, as the files and transformers 4.57 name it)."""

    module: str
    expert: int
    first_row: int
    rows: int


def file_pieces(model: torch.nn.Module, name: str, experts: int, rows: int) -> list[Piece] | None:
    """How ``save_pretrained`` writes the fused expert tensor ``name`` ((``experts``, ``rows``, in), rows the
    output features): one 2-D weight per expert and projection, in expert then row order. None where the files keep
    it fused too (GPT-OSS, GraniteMoE) or the stack does not fuse it (transformers 4.57)."""
    probe = torch.arange(experts * rows, dtype=torch.float64).reshape(experts, rows, 1)  # each row's index
    written = saved_format(model, {name: probe})
    pieces = []
    for file_name, tensor in written.items():
        if file_name == name or tensor.dim() != 2 or tensor.shape[1] != 1:
            return None
        index = tensor.flatten().long()
        expert, first = divmod(int(index[0]), rows)
        if first + len(index) > rows or not torch.equal(index, torch.arange(int(index[0]), int(index[0]) + len(index))):
            return None  # not a run of one expert's rows: no layout moeflow converts
        pieces.append(Piece(file_name.removesuffix(".weight"), expert, first, len(index)))
    return sorted(pieces, key=lambda p: (p.expert, p.first_row)) or None


def fused_adapters(model: Any) -> dict[str, tuple[str, int]]:
    """Each fused routed-expert tensor with an adapter, by its base-model name: the key its factors are saved
    under (without ``.lora_A.weight``) and their rank. peft's wrappers and moeflow.model.expert_lora's factors."""
    from peft.tuners.lora import ParamWrapper

    found = {}
    for path, layer in model.named_modules():
        if isinstance(layer, ParamWrapper) and ADAPTER_NAME in layer.lora_A:
            name = P.base_name(P.clean_name(f"{path}.{layer.parameter_name}"))
            # (experts, out, in) tensors only: GPT-OSS's (experts, in, out) are fused in its files too
            if P.category(name) == P.ROUTED_EXPERTS and getattr(layer, "_did_swap_in_out_features", False):
                found[name] = (P.clean_name(path), int(layer.r[ADAPTER_NAME]))
    for path, module in expert_lora.adapted_modules(model):
        for tensor, wrapper in expert_lora.peft_names(P.clean_name(path), module).items():
            if not expert_lora.adapted_tensors(module)[tensor][1]:  # (experts, out, in)
                rank = module._parameters[expert_lora.factor_names(tensor)[0]].shape[1]
                found[P.base_name(P.clean_name(f"{path}.{tensor}"))] = (wrapper, rank)
    return found


def record_pieces(model: Any, folder: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write :data:`PIECES_FILE` into an adapter folder whose fused expert adapters the files split by expert, from
    the saved ``weights``: what a reader on transformers 4.57 needs to place them."""
    from moeflow.model.wrappers import unwrap

    base = unwrap(model, peft=True)
    record = {}
    for name, (key, rank) in sorted(fused_adapters(model).items()):
        a, b = weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"]
        pieces = file_pieces(base, name, a.shape[0] // rank, b.shape[0])
        if pieces is not None:
            record[name] = {
                "adapter": key,
                "rank": rank,
                "pieces": [[p.module, p.expert, p.first_row, p.rows] for p in pieces],
            }
    if record:
        write_json(folder / PIECES_FILE, record)


def _factors_by_expert(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's fused factors (r x experts, in) and (out, r x experts) as (experts, r, in) and (experts, out, r)."""
    experts = a.shape[0] // rank
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)


def split_fused(
    weights: dict[str, torch.Tensor], folder: Path, model: torch.nn.Module | None
) -> dict[str, torch.Tensor]:
    """``weights`` of an adapter saved on transformers 5 with its fused expert adapters given to the modules
    :data:`PIECES_FILE` names, where ``model`` (the base) has those modules, or every one with ``model`` None (the
    files' layout, which serving engines read: moeflow.serving.adapter); ``weights`` unchanged otherwise."""
    if not (folder / PIECES_FILE).is_file():
        return weights
    modules = None if model is None else dict(model.named_modules())
    weights = dict(weights)
    for entry in read_json(folder / PIECES_FILE).values():
        pieces = [Piece(*p) for p in entry["pieces"]]
        if modules is not None and pieces[0].module not in modules:
            continue  # this model holds the tensor fused too
        keys = [f"{entry['adapter']}.lora_{factor}.weight" for factor in "AB"]
        if not all(key in weights for key in keys):
            raise AdapterLayoutError(
                f"{folder / PIECES_FILE} names the adapter {entry['adapter']}, which its weights lack: "
                f"{len(pieces)} expert modules ({pieces[0].module}, ...) would have none; an adapter that lost "
                "experts is not loaded"
            )
        a, b = _factors_by_expert(weights.pop(keys[0]), weights.pop(keys[1]), entry["rank"])
        for p in pieces:
            weights[f"{PEFT_PREFIX}{p.module}.lora_A.weight"] = a[p.expert].clone()
            weights[f"{PEFT_PREFIX}{p.module}.lora_B.weight"] = b[p.expert, p.first_row : p.first_row + p.rows].clone()
    return weights


@dataclass
class FusedAdapter:
    """One fused tensor's adapter assembled from per-expert ones: factors (experts, rank, in) and (experts, out,
    rank), and the multiple of ``train.lora.rank`` (and alpha) it needs."""

    a: torch.Tensor
    b: torch.Tensor
    times: int


def fuse_pieces(
    weights: dict[str, torch.Tensor], model: torch.nn.Module, names: list[str], rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, FusedAdapter]]:
    """The per-expert adapters in ``weights`` (saved on transformers 4.57) of each fused tensor of ``names`` in
    ``model`` (the base, transformers 5), assembled per tensor and taken out of ``weights``. Raises naming the
    modules whose adapters are missing where the adapter has some of a tensor's pieces but not all."""
    weights = dict(weights)
    fused: dict[str, FusedAdapter] = {}
    if not any(PER_EXPERT_MODULE.search(key) for key in weights):
        return weights, fused  # saved on this layout: nothing to assemble
    for name in names:
        shape = _shape(model, name)
        pieces = file_pieces(model, name, shape[0], shape[1])
        if pieces is None:
            continue
        keys = [(f"{PEFT_PREFIX}{p.module}.lora_A.weight", f"{PEFT_PREFIX}{p.module}.lora_B.weight") for p in pieces]
        present = [a in weights and b in weights for a, b in keys]
        if not any(present):
            continue
        if not all(present):
            lost = [p.module for p, here in zip(pieces, present) if not here]
            raise AdapterLayoutError(
                f"the adapter has per-expert adapters for {name} but none for {len(lost)} of its {len(pieces)} "
                f"modules: {lost[:6]}; an adapter that lost experts is not loaded"
            )
        per_expert: dict[int, list[tuple[Piece, torch.Tensor, torch.Tensor]]] = {}
        for p, (a_key, b_key) in zip(pieces, keys):
            per_expert.setdefault(p.expert, []).append((p, weights.pop(a_key), weights.pop(b_key)))
        shared = all(torch.equal(group[0][1], piece[1]) for group in per_expert.values() for piece in group)
        times = 1 if shared else len(per_expert[0])
        if len(per_expert) != shape[0] or any(len(group) != len(per_expert[0]) for group in per_expert.values()):
            raise AdapterLayoutError(f"{name}: the files' pieces do not cover each of its experts alike")
        a_all, b_all = [], []
        for expert in range(shape[0]):
            group = per_expert[expert]
            a = group[0][1] if shared else torch.cat([piece[1] for piece in group])
            b = torch.zeros(shape[1], rank * times, dtype=group[0][2].dtype)
            for i, (p, _, piece_b) in enumerate(group):
                columns = slice(0, rank) if shared else slice(i * rank, (i + 1) * rank)
                b[p.first_row : p.first_row + p.rows, columns] = piece_b
            a_all.append(a)
            b_all.append(b)
        fused[name] = FusedAdapter(torch.stack(a_all), torch.stack(b_all), times)
    return weights, fused


def _shape(model: torch.nn.Module, name: str) -> tuple[int, ...]:
    """A weight's dense shape, a quantized one's (model.quantization) too."""
    quantized = quantized_weights(model).get(name)
    return tuple(quantized.dequantize.packing.shape if quantized else model.get_parameter(name).shape)


def place_fused(
    model: Any, weights: dict[str, torch.Tensor], fused: dict[str, FusedAdapter]
) -> dict[str, torch.Tensor]:
    """``weights`` with :func:`fuse_pieces`' adapters under the keys the LoRA ``model``'s wrappers load."""
    keys = fused_adapters(model)
    weights = dict(weights)
    for name, adapter in fused.items():
        key = keys[name][0]
        weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"] = expert_lora.peft_factors(
            adapter.a, adapter.b
        )
    return weights


def file_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The name in the files of each of ``tensors`` (2-D weights the files hold as they are, a router's): model
    name -> file name."""
    return {name: next(iter(saved_format(model, {name: tensor}))) for name, tensor in tensors.items()}
