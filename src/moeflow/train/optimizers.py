"""The Trainer's optimizer for ``train.optimizer``: AdamW, or Muon for the hidden matrices with AdamW for the rest.

``muon`` follows StepFun's Step-3.5-Flash recipe: Muon (torch.optim.Muon's update, torch 2.9+, the current stack)
for the hidden layers' weight matrices (``moeflow.model.parameters.is_hidden_matrix``), AdamW for the embedding,
the LM head, norms, biases and routers. Where transformers 5 fuses a layer's experts into one ``[E, out, in]``
tensor, each expert's ``[out, in]`` slice is its own matrix: orthogonalised and learning-rate-adjusted on its
own, exactly as torch.optim.Muon updates a separate 2-D weight (torch.optim.Muon itself refuses a 3-D
parameter). Muon keeps one momentum buffer per matrix parameter (AdamW two moments): checkpoints store it as
any optimizer tensor (moeflow.checkpoint.state), and the memory planner counts it so (moeflow.plan.memory).
"""

from __future__ import annotations

from typing import Any

import torch

from moeflow.model import parameters as P
from moeflow.model.wrappers import unwrap
from moeflow.parallel import dtensors
from moeflow.parallel.layouts import original_shape
from moeflow.settings import typed
from moeflow.train.param_groups import param_groups
from moeflow.train.settings import MuonSettings


class OptimizerConfigError(ValueError):
    """``train.optimizer`` asked for what this stack or layout cannot do."""


def build_optimizer(
    model: torch.nn.Module, settings: Any, groups: list[dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``settings`` (a ``moeflow.train.settings.TrainSettings``) name, over ``groups`` (default
    ``param_groups``; ESFT's masked groups from the Trainer), each group's ``lr_multiplier`` kept. No learning
    rate here: moeflow.train.param_groups.set_learning_rate writes it, before every step."""
    groups = param_groups(model, settings) if groups is None else groups
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(groups, betas=settings.betas, eps=settings.eps)
    if settings.optimizer != "muon":
        raise OptimizerConfigError(f"config key 'train.optimizer': {settings.optimizer!r}; use adamw or muon")
    muon = settings.muon or typed(MuonSettings, {})
    return MuonWithAdamW(muon_split(model, groups), betas=settings.betas, eps=settings.eps, muon=muon)


def muon_split(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with the hidden matrices moved into groups of their own, marked ``muon: True`` (the others
    ``muon: False``); a group left empty is dropped."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    out = []
    for group in groups:
        for muon in (False, True):
            params = [p for p in group["params"] if P.is_hidden_matrix(names[id(p)], original_shape(p)) == muon]
            if params:
                out.append({**group, "params": params, "muon": muon, "name": group["name"] + ("_muon" if muon else "")})
    return out


def matrices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The 2-D matrices of a parameter (or its gradient, or its momentum buffer) as views: itself, or each
    expert's slice of a fused ``[E, out, in]`` tensor."""
    return [tensor] if tensor.dim() == 2 else list(tensor.reshape(-1, *tensor.shape[-2:]).unbind(0))


class SlicedMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update (its functional ``torch.optim._muon.muon``) on every matrix of each parameter
    (:func:`matrices`): a 2-D weight as torch.optim.Muon updates it, a fused expert tensor one expert's slice at
    a time, through views of the parameter, its gradient and its one momentum buffer (state
    ``momentum_buffer``, shaped as the parameter, as torch.optim.Muon's). A sharded fused expert tensor whose
    ranks hold whole experts is updated where it lies (:func:`holds_whole_matrices`); any other sharded
    parameter (a 2-D matrix split by rows) is gathered whole for its update (:func:`gathered_step`)."""

    def __init__(self, params, *, weight_decay: float, settings: MuonSettings):
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

        defaults = {
            "lr": 0.0,  # set before every step (moeflow.train.param_groups.set_learning_rate)
            "weight_decay": weight_decay,
            "momentum": settings.momentum,
            "nesterov": settings.nesterov,
            "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C),
            "eps": EPS,
            "ns_steps": settings.ns_steps,
            "adjust_lr_fn": settings.adjust_lr,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise OptimizerConfigError(
                        f"Muon takes 2-D matrices or fused [E, out, in] experts, got {list(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import muon

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            settings = {k: group[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "eps", "ns_steps")}
            settings |= {"ns_coefficients": tuple(group["ns_coefficients"]), "adjust_lr_fn": group["adjust_lr_fn"]}
            params, grads, buffers = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                if dtensors.is_dtensor(p) and not holds_whole_matrices(p):
                    gathered_step(p, state["momentum_buffer"], settings)
                    continue
                params += matrices(dtensors.local_tensor(p))
                grads += matrices(dtensors.local_tensor(p.grad))
                buffers += matrices(dtensors.local_tensor(state["momentum_buffer"]))
            muon(params, grads, buffers, **settings, has_complex=False)
        return loss


def holds_whole_matrices(param: torch.Tensor) -> bool:
    """Whether each rank holds whole matrices of a sharded parameter: a fused ``[E, out, in]`` expert tensor split
    along its experts only (FSDP2's ``Shard(0)``; expert parallelism's ``Shard(0)`` and ``_StridedShard(0)``).
    Muon then updates the rank's own experts where they are, with no communication."""
    placements = [param.placements[dim] for dim in dtensors.split_mesh_dims(param)]
    return param.dim() == 3 and all(getattr(placement, "dim", None) == 0 for placement in placements)


def gathered_step(param: torch.Tensor, buffer: torch.Tensor, settings: dict[str, Any]) -> None:
    """Muon's update of a sharded (DTensor, FSDP2) parameter: its weight, gradient and momentum buffer gathered
    whole on every rank, updated as an unsharded one, and each rank keeps its own shard of the result (every
    rank computes the same whole update from the same gathered values)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.optim._muon import muon

    whole, momentum = param.full_tensor(), buffer.full_tensor()
    muon(matrices(whole), matrices(param.grad.full_tensor()), matrices(momentum), **settings, has_complex=False)
    for target, value in ((param, whole), (buffer, momentum)):
        mine = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: torch.optim.AdamW for the groups marked ``muon: False``, :class:`SlicedMuon` for
    those marked ``muon: True``. Both share this optimizer's group dicts (a learning rate set here reaches them)
    and its ``state`` (their parameters are disjoint), so checkpoints and the Trainer see one optimizer."""

    def __init__(self, groups: list[dict[str, Any]], *, betas: tuple[float, float], eps: float, muon: MuonSettings):
        if not hasattr(torch.optim, "Muon"):
            raise OptimizerConfigError(
                f"config key 'train.optimizer': muon needs torch.optim.Muon (torch 2.9+, the current stack); this "
                f"environment has torch {torch.__version__}. Run with STACK=current, or use optimizer: adamw"
            )
        adamw = [g for g in groups if not g["muon"]]
        matrices_ = [g for g in groups if g["muon"]]
        self.adamw = torch.optim.AdamW(adamw, betas=betas, eps=eps) if adamw else None
        self.muon = SlicedMuon(matrices_, weight_decay=0.0, settings=muon) if matrices_ else None
        parts = [o for o in (self.adamw, self.muon) if o is not None]
        super().__init__([g for o in parts for g in o.param_groups], {})
        for part in parts:
            part.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in (self.adamw, self.muon):
            if part is not None:
                part.step()
        return loss
