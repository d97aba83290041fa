"""The layouts of ``parallel.strategy``: FSDP (FSDP2 or FSDP1) and transformers' expert parallelism.

FSDP is FSDP2 ``fully_shard`` on the current stack and FSDP1 on the pinned one; the module also holds what every
layout answers the same way (reshard, the whole state dict).

* ``parallel.strategy``:

  - ``none``: every rank holds the whole model; :func:`reduce_gradients` sums the gradients over ranks.
  - ``fsdp``: :func:`shard_model` wraps the model, one FSDP unit per decoder layer plus the root:
    FSDP2 ``fully_shard`` on the current stack; FSDP1 ``FullyShardedDataParallel(use_orig_params=True)``
    on the pinned stack, whose torch 2.3.1 ``fully_shard`` fails without CUDA. With ``precision: bf16``,
    FSDP's mixed precision (bf16 gathers and compute, fp32 shards and gradient reduction). With
    ``parallel.cpu_offload`` (FSDP2 only) every unit offloads (:func:`cpu_offload_policy`): the shards, their
    gradients and so AdamW's state stay on the host, one rank shards over a group of one, and the device the model
    computes on is recorded (moeflow.runtime.host_copies.model_device), its parameters being on the host.
  - ``ep``: transformers 5 shards the model on the meta device as its ``from_pretrained`` does for
    ``DistributedConfig(ep_size=..., fsdp_size=...)`` (moeflow.loading.factory): experts split over ``ep_size``
    ranks, the rest FSDP2-sharded; each rank then reads its rows (moeflow.parallel.rank_load).
    transformers 4.57 (pinned stack) has no expert parallelism: a clear error.

* The losses are normalised by the step's global token count (``moeflow.train.losses`` all-reduces the counts),
  so the gradient of a step is the *sum* of the ranks' gradients. FSDP (ours and transformers') averages
  over the data-parallel ranks; :func:`reduce_gradients` multiplies by their number (exact for powers of
  two) and, for an unsharded model, all-reduces the sum (the Trainer's one gradient reduction).
* :func:`clip_grad_norm`, :func:`state_pieces` (each rank's own pieces of the weights and AdamW state,
  for the DCP checkpoints of ``moeflow.checkpoint.state``, which reshard to any layout and world size),
  :func:`full_state_dict` (the whole state, for tests and comparisons) and :func:`full_gradients`
  (tests, debugging) work for all three layouts; the final model is ``moeflow.checkpoint.export``'s (every rank
  together, one whole tensor at a time).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from moeflow.model.parameters import clean_name
from moeflow.model.wrappers import is_fsdp1
from moeflow.parallel import dtensors
from moeflow.parallel.process_group import DistributedError, Ranks, world_size
from moeflow.parallel.rank_load import (
    has_meta_parameters,
    materialize,
    materialize_parameters,
)
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.runtime.host_copies import set_compute_device


def distributed_config(
    parallel: ParallelSettings,
    precision: str,
    world: int | None = None,
    adapters: bool = False,
    ep_plan: dict[str, str] | None = None,
):
    """transformers 5's ``DistributedConfig`` for ``strategy: ep`` (experts over ``ep_size`` ranks, the rest
    FSDP2-sharded over ``fsdp_size``, default all ranks). With ``precision: bf16``, transformers' FSDP2
    mixed precision: :func:`fsdp2_mixed_precision`'s policy (bf16 parameters, fp32 reduction); none for a LoRA
    model (``adapters``: its frozen base is bf16 already, its fp32 adapters are gathered as they are, as under
    ``fsdp``). ``ep_plan``: the plan with a LoRA model's expert factors (moeflow.model.expert_lora.ep_plan)."""
    if parallel.strategy != "ep":
        raise DistributedError(
            f"parallel.strategy is {parallel.strategy!r}: transformers' DistributedConfig is for strategy: ep"
        )
    if not compat.is_transformers_v5():
        raise DistributedError(
            "config key 'parallel.strategy': ep (expert parallelism) needs transformers 5's DistributedConfig, and "
            f"this stack has transformers {compat.version_of('transformers')}, which has no expert parallelism: run "
            "with STACK=current, or use parallel.strategy: fsdp (FSDP1 here shards the experts with everything else)"
        )
    from transformers.distributed import DistributedConfig

    world = world or world_size()
    fsdp = parallel.fsdp_size or world
    if world % fsdp or fsdp % parallel.ep_size:
        raise DistributedError(
            f"parallel.ep_size {parallel.ep_size} and fsdp_size {fsdp} do not tile the {world} ranks torchrun started "
            "(ep_size must divide fsdp_size, fsdp_size must divide the ranks)"
        )
    return DistributedConfig(
        ep_size=parallel.ep_size,
        fsdp_size=fsdp,
        dp_replicate_size=world // fsdp,
        ep_implementation=parallel.ep_implementation,
        fsdp_mixed_precision=precision == "bf16" and not adapters,
        **({"ep_plan": ep_plan} if ep_plan else {}),
    )


def _layer_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The decoder-layer classes (transformers' ``_no_split_modules``): one FSDP unit each."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise DistributedError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules): cannot place FSDP units"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def shard_model(
    model: torch.nn.Module, parallel: ParallelSettings, ranks: Ranks, precision: str, adapters: bool = False
) -> torch.nn.Module:
    """The model for this layout: unsharded for ``none``, as transformers sharded it for ``ep``, FSDP-wrapped
    for ``fsdp`` (FSDP2 on the current stack, FSDP1 on the pinned one). Call before the optimizer is built.

    With ``precision: bf16``, FSDP's mixed precision: the shards (AdamW's master weights) stay fp32, each
    unit is all-gathered in bf16 and computes in bf16, gradients are reduce-scattered in fp32 (half the
    traffic of fp32 gathers; the Trainer's autocast keeps the losses fp32). A LoRA model (``adapters``) holds
    its frozen base in bf16 already and its adapters in fp32: each is gathered in its own dtype and the
    Trainer's autocast computes, as in one process (:func:`fsdp2_mixed_precision`)."""
    if parallel.strategy != "fsdp" or (ranks.world_size == 1 and not parallel.cpu_offload):
        if parallel.strategy == "ep":  # sharded on the meta device by transformers (moeflow.loading.factory)
            return materialize(model, ranks.device) if has_meta_parameters(model) else model
        return materialize(model, ranks.device) if has_meta_parameters(model) else model.to(ranks.device)
    layers = _layer_classes(model)
    if compat.fsdp2_available():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # No whole-model .to(device) first (114 GiB fp32 for Qwen3-30B-A3B on one 80 GB GPU): fully_shard moves
        # each unit's parameters and buffers to the mesh's device as it shards them, and the root unit takes
        # everything outside the layers (embeddings, final norm, output layer, rotary buffers).
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        offload = cpu_offload_policy(parallel, ranks)
        policy = fsdp2_mixed_precision(precision, adapters) | offload
        if policy and not adapters:  # before their layers: FSDP2 shards a submodule before the module holding it
            for module in fp32_modules(model):
                fully_shard(module, mesh=mesh, **fsdp2_mixed_precision("fp32"), **offload)
        for module in list(model.modules()):
            if isinstance(module, layers):
                fully_shard(module, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        if offload:  # its parameters stay on the host: where it computes is said, not read from them
            set_compute_device(model, ranks.device)
            return materialize(model, torch.device("cpu"), ranks.device) if has_meta_parameters(model) else model
        return materialize(model, ranks.device) if has_meta_parameters(model) else model
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    for param in model.parameters():  # FSDP1 turns them into flat 1-D shards; FSDP2 keeps the shapes
        param._moeflow_shape = tuple(param.shape)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy(set(layers)),
        use_orig_params=True,  # parameter names (and so AdamW's groups) stay those of the model
        device_id=ranks.device,  # torch 2.3 assumes CUDA unless told (gloo on CPU needs device_id=cpu)
        sync_module_states=False,  # every rank built or loaded the same weights
        # A model on the meta device (moeflow.parallel.rank_load): each unit gets empty shards as it is wrapped
        param_init_fn=materialize_parameters(ranks.device) if has_meta_parameters(model) else None,
        # Buffers stay fp32 (FSDP2 casts none either): rotary inv_freq in bf16 would shift the angles of
        # late positions by radians.
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else None,
    )


def cpu_offload_policy(parallel: ParallelSettings, ranks: Ranks) -> dict[str, Any]:
    """``fully_shard``'s offload keyword for ``parallel.cpu_offload``: the shards, their gradients and so AdamW's
    state on the host, each unit copied to the device for its forward and backward (page-locked host memory on
    CUDA, for copies that overlap the compute)."""
    if not parallel.cpu_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=ranks.device.type == "cuda")}


def fsdp2_mixed_precision(precision: str, adapters: bool = False) -> dict[str, Any]:
    """``fully_shard``'s mixed-precision keyword for ``precision``: bf16 parameters, fp32 reduction (the
    policy transformers' ``DistributedConfig(fsdp_mixed_precision=True)`` uses for ``strategy: ep``); fp32:
    parameters and reduction in fp32 (the modules :func:`fp32_modules` names, under a bf16 model). A LoRA
    model's (``adapters``) under bf16: no cast, fp32 reduction of the adapters' gradients. Casting its fp32
    adapters to bf16 for the gather would round them where one process's autocast rounds only the matmul's
    inputs, and its routers stay in the dtype the model class keeps them in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16" and adapters:
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)}
    if precision == "fp32":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
    if precision != "bf16":
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def fp32_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose own parameters the model class keeps in fp32 (transformers'
    ``_keep_in_fp32_modules_strict``: DeepSeek-V3's and Step-3.5's routers, ``gate.weight``), which moeflow's
    FSDP2 mixed precision gathers and computes in fp32 as their own units, under ``strategy: fsdp`` and (through
    :func:`fp32_units_for_expert_parallel`) ``strategy: ep``."""
    patterns = [
        re.compile(rf"(^|\.){re.escape(p)}$") for p in getattr(model, "_keep_in_fp32_modules_strict", None) or []
    ]
    if not patterns:
        return []
    return [
        module
        for prefix, module in model.named_modules()
        if any(
            rule.search(f"{prefix}.{name}" if prefix else name)
            for name, _ in module.named_parameters(recurse=False)
            for rule in patterns
        )
    ]


def fp32_units_for_expert_parallel(model: torch.nn.Module, config: Any, mesh_manager: Any) -> None:
    """Under ``strategy: ep`` with bf16 mixed precision: the modules :func:`fp32_modules` names become fp32 FSDP2
    units on the mesh transformers shards the rest of the model on, before it does (``maybe_distribute_model``):
    its FSDP applies one bf16 policy to every unit it makes, which would gather the routers' weights in bf16.
    Its own plan then leaves these modules out (where it builds in bf16 it gives them units of their own too, in
    its bf16 policy, and a second ``fully_shard`` of a module is an error)."""
    if mesh_manager is None or config.dp_size <= 1 or not config.fsdp_mixed_precision:
        return
    modules = fp32_modules(model)
    if not modules:
        return
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = mesh_manager.get_mesh(("dp_replicate", "fsdp") if config.dp_replicate_size > 1 else "fsdp")
    for module in modules:
        fully_shard(module, mesh=mesh, **fsdp2_mixed_precision("fp32"))
    resolve = model._resolve_parallel_plans

    def plans_without_fp32_units(distributed_config):
        tp_plan, ep_plan, fsdp_plan = resolve(distributed_config)
        return (
            tp_plan,
            ep_plan,
            {n: s for n, s in fsdp_plan.items() if not isinstance(model.get_submodule(n), FSDPModule)},
        )

    model._resolve_parallel_plans = plans_without_fp32_units


def original_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape in the model, also once FSDP1 has made it a flat 1-D shard (for AdamW's
    groups: weight decay on parameters of 2 or more dimensions; for parameter counts)."""
    return getattr(param, "_moeflow_shape", None) or tuple(param.shape)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether parameters are sharded (FSDP1, FSDP2 or transformers' EP/FSDP), i.e. FSDP reduces gradients."""
    if is_fsdp1(model):
        return True
    return any(dtensors.is_dtensor(p) for p in model.parameters())


def _state_dict_options(full_state_dict: bool = True, **kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full_state_dict, **kwargs)


def full_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, rank0_only: bool = False
) -> tuple[dict, dict | None]:
    """Whole (unsharded) model and optimizer state on every rank, keyed by parameter name as the unwrapped
    model names them (the optimizer's too: ``{"state": {name: {...}}, "param_groups": [{"params": [names]}]}``),
    in one format for every layout and world size: what the safetensors checkpoint writes. A collective:
    every rank calls it. ``rank0_only``: gathered into rank 0's CPU memory only (the other ranks may get
    empty states), as a writer on rank 0 needs: no rank holds the whole model on its device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # (torch 2.3's FSDP1 crashes offloading a model that is on the CPU already: there every rank gathers)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    options = _state_dict_options(cpu_offload=rank0_only and is_sharded(model) and not (is_fsdp1(model) and on_cpu))
    with _cpu_safe_fsdp1():
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return {clean_name(k): v for k, v in model_state.items()}, optim_state


@contextlib.contextmanager
def _cpu_safe_fsdp1() -> Iterator[None]:
    """torch 2.3's FSDP1 gathers optimizer state with a debugging ``torch.cuda.synchronize()`` that fails
    without CUDA (torch/distributed/fsdp/_optim_utils.py); on a machine without CUDA it has nothing to wait for."""
    if torch.cuda.is_available():
        yield
        return
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = synchronize


@contextlib.contextmanager
def generation_model(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The module to call ``generate`` on (and to run its forwards through) in the body. ``generate`` calls its
    model's own forward, which FSDP1's wrapper never sees: under FSDP1 the root unit's parameters (embeddings,
    final norm, head) are gathered for the body, every rank together (each decoder layer's unit gathers its
    own in its forward as usual), and the model inside the wrapper is yielded. Other layouts: the model itself;
    FSDP2's units are resharded after (it keeps the root gathered after a forward)."""
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with _cpu_safe_fsdp1(), FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
            yield model.module
        return
    try:
        yield model
    finally:
        reshard(model)


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters. FSDP2 keeps the root unit gathered after a forward pass
    (the backward pass needs it at once): after a forward without backward (evaluation) the model's
    registered parameters are the gathered ones, which the optimizer does not know, and a state dict of them
    would be whole tensors. A no-op for other layouts."""
    if not compat.fsdp2_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
