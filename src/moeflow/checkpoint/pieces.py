"""Each rank's own pieces of the training state for checkpoints: every tensor flattened, as views.

A rank's share of a flattened tensor is the contiguous range of elements its layout already holds (FSDP1's flat
shard, a DTensor's rows, the whole tensor unsharded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.checkpoint.storage import Piece
from moeflow.model.parameters import clean_name
from moeflow.model.wrappers import is_fsdp1, unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.layouts import reshard
from moeflow.parallel.process_group import DistributedError
from moeflow.parallel.rank_load import local_pieces, persistent_buffers


@dataclass
class StatePieces:
    """This rank's pieces of the training state (``moeflow.checkpoint.storage.Piece``: a contiguous range of
    each tensor's flattened elements, a view of the rank's own storage), keyed by the unwrapped model's
    names (a tied parameter by its first name): ``model`` every parameter and persistent buffer,
    ``optimizer`` ``{name: {state key: piece}}`` for the optimizer's tensors; ``scalars`` its state values
    that are not tensors (``{name: {key: value}}``) and ``param_groups`` its groups (parameter names for
    the parameters)."""

    model: dict[str, Piece]
    optimizer: dict[str, dict[str, Piece]]
    scalars: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (AdamW's moments, zeros) as torch.distributed.checkpoint does before it
    loads one: a step on zero gradients. torch keeps this private, so moeflow calls it here only."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def state_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, init_optimizer: bool = False
) -> StatePieces:
    """This rank's pieces of the model's and optimizer's state, in every layout, with no copy and no
    collective: FSDP1's flat shard holds a range of each parameter's elements (``_shard_param_infos``),
    FSDP2's and expert parallelism's DTensors hold dim-0 rows, an unsharded model every tensor whole (each
    rank the same: a checkpoint writes it once). ``init_optimizer``: give a fresh optimizer its state
    first (torch.distributed.checkpoint's step on zero gradients; on torch 2.3 AdamW's weight decay then
    moves the weights, which a checkpoint's load overwrites). Without an optimizer: the model's only."""
    reshard(model)
    if init_optimizer:
        init_optimizer_state(optimizer)
    inner, fsdp1 = unwrap(model), is_fsdp1(model)
    names = {id(param): clean_name(name) for name, param in inner.named_parameters()}
    of_param = _fsdp1_pieces(model) if fsdp1 else {}
    params = {id(param): of_param.get(id(param)) or _tensor_piece(param) for param in inner.parameters()}
    pieces = StatePieces({names[i]: piece for i, piece in params.items()}, {}, {}, [])
    for name, buffer in persistent_buffers(inner):
        pieces.model[name] = _tensor_piece(buffer)
    if optimizer is None:
        return pieces
    if fsdp1:
        # An FSDP1 rank holds no elements of some parameters: their gradient there is None, and so is their
        # optimizer state in an uninterrupted run. A state the zero-gradient step made for them would keep
        # the step count it was loaded with while the owning ranks count on, and could be the one saved.
        for param in [p for p in optimizer.state if not params[id(p)].local.numel()]:
            del optimizer.state[param]
    for param, per_param in optimizer.state.items():
        name, like = names[id(param)], params[id(param)]
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                pieces.scalars.setdefault(name, {})[key] = value
                continue
            if fsdp1 and value.dim() and value.numel() == like.local.numel():
                piece = Piece(value.detach().view(-1), like.offset, like.shape)  # shaped as the rank's flat range
            else:
                piece = _tensor_piece(value)
            pieces.optimizer.setdefault(name, {})[key] = piece
    for group in optimizer.param_groups:
        saved = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        pieces.param_groups.append({**saved, "params": [names[id(p)] for p in group["params"]]})
    return pieces


def _tensor_piece(value: torch.Tensor) -> Piece:
    """A DTensor's local rows, or a whole tensor, as a piece (a 0-d tensor: one element)."""
    shape = tuple(value.shape)
    if not dtensors.is_dtensor(value):
        return Piece(value.detach().view(-1), 0, shape)
    found = local_pieces(value)
    local, offsets = found[0]
    if len(found) > 1 or any(offsets[1:]) or tuple(local.shape[1:]) != shape[1:]:
        raise DistributedError(
            f"a DTensor sharded other than along dim 0 ({value.placements}, shape {list(shape)}): checkpoints "
            "store each rank's contiguous elements; this layout's pieces are not contiguous"
        )
    row = math.prod(shape[1:])
    return Piece(local.detach().view(-1), offsets[0] * row if offsets else 0, shape)


def _fsdp1_pieces(model: torch.nn.Module) -> dict[int, Piece]:
    """Each original parameter's range of elements in this rank's FSDP1 flat shards, by ``id(param)``. The
    local shard, not the parameter's view: FSDP1 leaves the root unit gathered after a forward pass (before
    FSDP1's lazy initialisation, at the first forward, the flat parameter is the local shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    pieces = {}
    for unit in model.modules():
        if not isinstance(unit, FullyShardedDataParallel) or unit._handle is None:
            continue
        flat = unit._handle.flat_param
        local_shard = getattr(flat, "_local_shard", flat.data)
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            if info.in_shard and info.numel_in_shard:
                start = info.offset_in_shard
                local = local_shard[start : start + info.numel_in_shard]
                pieces[id(param)] = Piece(local, info.intra_param_start_idx, tuple(shape))
            else:
                pieces[id(param)] = Piece(local_shard[:0], 0, tuple(shape))
    return pieces
