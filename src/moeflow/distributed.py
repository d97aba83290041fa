"""Ranks, sharding and expert parallelism for the training loop, on PyTorch's and transformers' own engines.

The training rules start their script through torchrun; this module turns torchrun's environment into
a process group and the config's ``parallel`` section into a sharded model:

* :func:`init` / :func:`teardown` (or the :func:`process_group` context): one process group from
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, gloo on CPU, nccl on CUDA; nothing at all in one process.
* ``parallel.strategy``:

  - ``none``: every rank holds the whole model; :func:`reduce_gradients` sums the gradients over ranks.
  - ``fsdp``: :func:`shard_model` wraps the model, one FSDP unit per decoder layer plus the root:
    FSDP2 ``fully_shard`` on the current stack; FSDP1 ``FullyShardedDataParallel(use_orig_params=True)``
    on the pinned stack, whose torch 2.3.1 ``fully_shard`` fails without CUDA. With ``precision: bf16``,
    FSDP's mixed precision (bf16 gathers and compute, fp32 shards and gradient reduction).
  - ``ep``: transformers 5 shards the model itself at ``from_pretrained`` (:func:`load_model`) through
    ``DistributedConfig(ep_size=..., fsdp_size=...)``: experts split over ``ep_size`` ranks, the rest
    FSDP2-sharded. transformers 4.57 (pinned stack) has no expert parallelism: a clear error.

* The losses are normalised by the step's global token count (``moeflow.losses`` all-reduces the counts),
  so the gradient of a step is the *sum* of the ranks' gradients. FSDP (ours and transformers') averages
  over the data-parallel ranks; :func:`reduce_gradients` multiplies by their number (exact for powers of
  two) and, for an unsharded model, all-reduces the sum (the Trainer's one gradient reduction).
* :func:`clip_grad_norm`, :func:`state_pieces` (each rank's own pieces of the weights and AdamW state,
  for the DCP checkpoints of ``moeflow.checkpoint``, which reshard to any layout and world size),
  :func:`full_state_dict` (the whole state, for tests and comparisons) and :func:`full_gradients`
  (tests, debugging) work for all three layouts; the final model is ``moeflow.export``'s (every rank
  together, one whole tensor at a time).
* The stage scripts: ``ranks = init(device)``, ``check_ranks(settings.parallel, ranks)``
  (torchrun started what the config asks for), :func:`load_for_training` (``fsdp``:
  parameters on the meta device, sharded, each rank reading its rows from the safetensors files,
  ``moeflow.sharded_load``; otherwise :func:`load_model`; LoRA, :func:`shard_model`), the Trainer,
  :func:`teardown`. Known limits: transformers 5's expert parallelism unties tied embeddings (refused),
  and its ``from_pretrained`` peaks at about 1.5x the model per rank at 2 ranks (measured: 615 MB over
  the runtime for a 394 MB qwen3_moe; fsdp: 427 MB); LoRA runs on several ranks with ``strategy: none`` only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import compat
from .checkpoint_storage import Piece
from .config import ParallelSettings, TrainSettings
from .hardware import compute_device
from .lora import prepare_model
from .modeling import _impl_kwargs, check_model_folder, check_vocabulary, model_section, with_chunked_loss
from .modeling import load_model as load_whole_model
from .parameters import clean_name
from .sharded_load import (
    _local_pieces,
    build_on_meta,
    fill_from_folder,
    has_meta_parameters,
    materialize,
    materialize_parameters,
    persistent_buffers,
    tied_names,
)

log = logging.getLogger("moeflow.distributed")


class DistributedError(RuntimeError):
    """A layout that cannot run here, naming the setting and what to do."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Ranks:
    """This process's place among torchrun's processes, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# --------------------------------------------------------------------------- process group


def check_ranks(parallel: ParallelSettings, ranks: Ranks) -> ParallelSettings:
    """The layout, if torchrun started the ranks it asks for; else a clear error. (The rule starts one
    rank per GPU of its ``resources.gpu``, or ``parallel.nproc_per_node`` CPU ranks: a profile and a
    config that disagree end here, before any work.)"""
    if ranks.world_size != parallel.world_size:
        raise DistributedError(
            f"torchrun started {ranks.world_size} rank(s), "
            "but config keys 'parallel.nproc_per_node' x 'parallel.nnodes' "
            f"ask for {parallel.world_size}: make the training rule's resources "
            "(gpu, nodes; set in the profile) and the "
            "config's parallel section agree (moeflow.scaleout.request_problems lists the differences)"
        )
    return parallel


def init(device_type: str | None = None) -> Ranks:
    """Join the process group torchrun describes (only with more than one process) and pick the device.

    ``device_type``: "cuda" or "cpu"; default: CUDA when available. The backend follows the device:
    nccl for CUDA tensors (and gloo for CPU ones) on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = compute_device(device_type)  # refuses CUDA without a GPU; TF32 on for CUDA
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            # With CUDA, nccl for the model's tensors and gloo for the CPU tensors the losses all-reduce
            # (token and expert counts, logged loss terms).
            dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo")
    return Ranks(rank, world, local_rank, device)


def teardown() -> None:
    """Leave the process group (all ranks together), if one was joined."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(device_type: str | None = None) -> Iterator[Ranks]:
    """:func:`init`, then :func:`teardown` when the body succeeds. On an error the group is left as it is
    (a barrier would wait forever for a rank that failed); torchrun stops the other ranks."""
    ranks = init(device_type)
    yield ranks
    teardown()


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else 0


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    import torch.distributed as dist

    if _initialized():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process."""
    import torch.distributed as dist

    if not _initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (a no-op in one process)."""
    if world_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


# --------------------------------------------------------------------------- expert parallelism (transformers 5)


def distributed_config(parallel: ParallelSettings, precision: str, world: int | None = None):
    """transformers 5's ``DistributedConfig`` for ``strategy: ep`` (experts over ``ep_size`` ranks, the rest
    FSDP2-sharded over ``fsdp_size``, default all ranks). With ``precision: bf16``, transformers' FSDP2
    mixed precision: :func:`fsdp2_mixed_precision`'s policy (bf16 parameters, fp32 reduction)."""
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
        fsdp_mixed_precision=precision == "bf16",
    )


def load_model(
    path: str | os.PathLike, model_cfg: Mapping[str, Any], parallel: ParallelSettings, precision: str, dtype: Any = None
):
    """Load a saved model folder for this layout: sharded by transformers at load time for ``ep``,
    whole (then :func:`shard_model`) otherwise. (``_from_config`` takes no DistributedConfig: an
    expert-parallel run needs a folder, such as the base model or a checkpoint's save_pretrained.)"""
    if parallel.strategy != "ep":
        return load_whole_model(path, model_cfg, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    trust = model_section(model_cfg)["trust_remote_code"]
    if getattr(
        AutoConfig.from_pretrained(check_model_folder(path), trust_remote_code=trust, local_files_only=True),
        "tie_word_embeddings",
        False,
    ):
        # Measured on transformers 5.24 (tests/test_train_distributed.py): the first step's gradients are
        # right, but the output layer and the embedding then train apart (loss 5e-4 off one process's at step 2).
        raise DistributedError(
            f"parallel.strategy: ep with a model whose embedding and output layer are tied (tie_word_embeddings in "
            f"{path}/config.json): transformers 5's expert-parallel sharding unties them during training. Use "
            "parallel.strategy: fsdp for this model, or a model with tie_word_embeddings: false (model.config)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        check_model_folder(path),
        use_safetensors=True,
        torch_dtype=dtype or torch.float32,
        trust_remote_code=trust,
        local_files_only=True,
        distributed_config=distributed_config(parallel, precision),
        **_impl_kwargs(model_cfg),
    )
    return with_chunked_loss(model, model_cfg)


def start_fine_tuning(job: Any, precision: str, weights: bool = True) -> tuple[Ranks, torch.nn.Module]:
    """What the warmup and train_model stages do first: start this rank's process group, check the ranks
    against the run's layout, and load the base model (``job.input.model``) for it, checked against the
    fine-tuning data's vocabulary (``job.input.data``). ``job``: ``stage.job_from_argv``'s, with settings.
    ``weights``: as :func:`load_for_training` takes it (False: a checkpoint will replace every weight)."""
    settings = job.settings
    ranks = init(settings.hardware_device)
    parallel = check_ranks(settings.parallel, ranks)
    model = load_for_training(
        job.input.model,
        settings.model,
        settings.train,
        parallel,
        ranks,
        job.input.data,
        precision=precision,
        weights=weights,
    )
    return ranks, model


def load_for_training(
    path: str | os.PathLike,
    model_cfg: Mapping[str, Any],
    train: TrainSettings,
    parallel: ParallelSettings,
    ranks: Ranks,
    data: str | os.PathLike | None = None,
    *,
    precision: str,
    weights: bool = True,
) -> torch.nn.Module:
    """A saved model folder, ready for the Trainer: loaded for the layout, checked against the vocabulary
    ``data`` (a tokenized split folder) was tokenized with (``moeflow.modeling.check_vocabulary``), with
    LoRA adapters for ``train.method: lora`` (``moeflow.lora.prepare_model``), then sharded
    (:func:`shard_model`, in ``precision``: before the optimizer is built). LoRA runs on several ranks
    with ``parallel.strategy: none`` only.

    ``fsdp`` (full fine-tuning, any number of ranks): built with parameters on the meta device, sharded,
    and each rank's shards read from the folder's safetensors files (``moeflow.sharded_load``): no rank
    holds what it does not own, and one rank holds the weights once (transformers 5's ``from_pretrained``
    keeps the files mapped beside the tensors it copies: ~1.3x the weights resident at one rank).
    ``none``, ``ep``, LoRA: :func:`load_model`. ``weights=False`` (the caller loads a checkpoint that
    replaces every parameter and persistent buffer): a full fine-tuning model gets uninitialised
    parameters, no weight is read (``ep`` and LoRA still load the folder: transformers shards ``ep`` at
    load, and peft wraps a loaded base model; the checkpoint then overwrites every parameter anyway)."""
    if train.method == "lora" and parallel.strategy != "none" and ranks.world_size > 1:
        raise DistributedError(
            f"config keys 'train.method': lora and 'parallel.strategy': {parallel.strategy} do not combine: "
            "LoRA adapters are "
            "not sharded here (peft over FSDP or expert parallelism is not built). "
            "Use parallel.strategy: none (every rank "
            "holds the frozen base model and the adapters; "
            "the adapters' gradients are summed over ranks), or train.method: full"
        )
    full = train.method == "full"
    on_meta = full and (parallel.strategy == "fsdp" or (parallel.strategy == "none" and not weights))
    model = build_on_meta(path, model_cfg) if on_meta else load_model(path, model_cfg, parallel, precision)
    if data is not None:
        check_vocabulary(model, [data], path)
    names_of = tied_names(model)
    model = shard_model(prepare_model(model, train), parallel, ranks, precision)
    if on_meta and weights:
        fill_from_folder(model, path, names_of)
    return model


# --------------------------------------------------------------------------- FSDP


def _layer_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The decoder-layer classes (transformers' ``_no_split_modules``): one FSDP unit each."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise DistributedError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules): cannot place FSDP units"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def fsdp2_available() -> bool:
    """Whether to use FSDP2 (``fully_shard``): torch >= 2.6 (the current stack). torch 2.3's early
    ``fully_shard`` needs CUDA, so the pinned stack uses FSDP1 on every device, one code path there."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 6)


def shard_model(model: torch.nn.Module, parallel: ParallelSettings, ranks: Ranks, precision: str) -> torch.nn.Module:
    """The model for this layout: unchanged for ``none`` and ``ep`` (already sharded at load), FSDP-wrapped
    for ``fsdp`` (FSDP2 on the current stack, FSDP1 on the pinned one). Call before the optimizer is built.

    With ``precision: bf16``, FSDP's mixed precision: the shards (AdamW's master weights) stay fp32, each
    unit is all-gathered in bf16 and computes in bf16, gradients are reduce-scattered in fp32 (half the
    traffic of fp32 gathers; the Trainer's autocast keeps the losses fp32)."""
    if parallel.strategy != "fsdp" or ranks.world_size == 1:
        if parallel.strategy == "ep":
            return model
        return materialize(model, ranks.device) if has_meta_parameters(model) else model.to(ranks.device)
    layers = _layer_classes(model)
    if fsdp2_available():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # No whole-model .to(device) first (114 GiB fp32 for Qwen3-30B-A3B on one 80 GB GPU): fully_shard moves
        # each unit's parameters and buffers to the mesh's device as it shards them, and the root unit takes
        # everything outside the layers (embeddings, final norm, output layer, rotary buffers).
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        policy = fsdp2_mixed_precision(precision)
        for module in list(model.modules()):
            if isinstance(module, layers):
                fully_shard(module, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
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
        # A model on the meta device (moeflow.sharded_load): each unit gets empty shards as it is wrapped
        param_init_fn=materialize_parameters(ranks.device) if has_meta_parameters(model) else None,
        # Buffers stay fp32 (FSDP2 casts none either): rotary inv_freq in bf16 would shift the angles of
        # late positions by radians.
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else None,
    )


def fsdp2_mixed_precision(precision: str) -> dict[str, Any]:
    """``fully_shard``'s mixed-precision keyword for ``precision``: bf16 parameters, fp32 reduction (the
    policy transformers' ``DistributedConfig(fsdp_mixed_precision=True)`` uses for ``strategy: ep``)."""
    if precision != "bf16":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def original_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape in the model, also once FSDP1 has made it a flat 1-D shard (for AdamW's
    groups: weight decay on parameters of 2 or more dimensions; for parameter counts)."""
    return getattr(param, "_moeflow_shape", None) or tuple(param.shape)


def is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether parameters are sharded (FSDP1, FSDP2 or transformers' EP/FSDP), i.e. FSDP reduces gradients."""
    if is_fsdp1(model):
        return True
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.3: DTensor lives in torch.distributed._tensor
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside an FSDP1 wrapper (FSDP2 and EP keep the model's own class)."""
    return model.module if is_fsdp1(model) else model


# --------------------------------------------------------------------------- gradients

GRADIENT_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket size


def reduce_gradients(model: torch.nn.Module, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Make every rank's gradients the step's summed gradient (the losses are normalised globally).

    Unsharded model: all-reduce (sum) in buckets of ``bucket_bytes`` (:func:`sum_in_buckets`). Sharded:
    FSDP has already reduce-scattered the mean over the data-parallel ranks, so multiply by their number."""
    world = world_size()
    if world == 1:
        return
    if not is_sharded(model):
        params = [p for p in model.parameters() if p.requires_grad]
        # A rank whose tokens missed an expert has no gradient for it (transformers 4.57 runs only the
        # experts that got tokens): agree first on which gradients exist anywhere, so that every rank
        # fills the same buckets in the same order, and a gradient no rank has stays None.
        present = all_reduce_sum(torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64))
        grads = []
        for p, anywhere in zip(params, present.tolist()):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()  # bucketed through a flat view
                grads.append(p.grad)
        sum_in_buckets(grads, bucket_bytes)
        return
    data_parallel = _data_parallel_size(model, world)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(data_parallel)


def sum_in_buckets(tensors: list[torch.Tensor], bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Sum contiguous tensors over ranks in place, in one all-reduce per bucket instead of one per tensor
    (a model's thousands of gradients: ~19k collectives a step on Qwen3-30B-A3B).

    Tensors of one dtype and device are copied, in order, into a flat buffer of ``bucket_bytes``, split
    across bucket boundaries where they do not fit, so a group of B bytes takes ceil(B / bucket_bytes)
    all-reduces; each reduced bucket is copied back. An element-wise sum: the same values as summing
    tensor by tensor. Every rank must pass the same shapes in the same order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.view(-1))
    for (dtype, device), flats in groups.items():
        capacity = max(1, bucket_bytes // dtype.itemsize)
        bucket = torch.empty(min(capacity, sum(f.numel() for f in flats)), dtype=dtype, device=device)
        pieces: list[tuple[torch.Tensor, int, int, int]] = []  # (flat tensor, its offset, bucket offset, length)
        filled = 0
        for flat in flats:
            start = 0
            while start < flat.numel():
                length = min(capacity - filled, flat.numel() - start)
                bucket[filled : filled + length].copy_(flat[start : start + length])
                pieces.append((flat, start, filled, length))
                filled += length
                start += length
                if filled == capacity:
                    _sum_bucket(bucket, filled, pieces)
                    pieces, filled = [], 0
        if filled:
            _sum_bucket(bucket, filled, pieces)


def _sum_bucket(bucket: torch.Tensor, filled: int, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
    """All-reduce the bucket's first ``filled`` elements and copy each piece back where it came from."""
    all_reduce_sum(bucket[:filled])
    for flat, start, offset, length in pieces:
        flat[start : start + length].copy_(bucket[offset : offset + length])


def release_gradients(model: torch.nn.Module) -> None:
    """Free FSDP1's flat gradients once ``zero_grad(set_to_none=True)`` has dropped the parameters' own:
    FSDP1 (torch 2.3) otherwise keeps each unit's gradient shard until the next forward, one more copy of
    the rank's weights through every checkpoint, evaluation and export between steps. Other layouts: the
    parameters' gradients are the gradients, already freed."""
    if not is_fsdp1(model):
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in model.modules():
        if isinstance(unit, FullyShardedDataParallel) and unit._handle is not None:
            unit._handle._reset_flat_param_grad_info_if_needed()


def _data_parallel_size(model: torch.nn.Module, world: int) -> int:
    """Ranks that see different data: all of them, but for transformers' tensor/pipeline parallel sizes."""
    config = getattr(unwrap(model), "config", None)
    dcfg = getattr(config, "distributed_config", None)
    if dcfg is not None and getattr(dcfg, "dp_size", None):
        return int(dcfg.dp_size)
    return world


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients of the whole (sharded) model to ``max_norm``; return the norm before clipping.

    Sharded models sum the squares of per-tensor norms in parameter order, so that the norm is the same
    from run to run (FSDP1's own ``clip_grad_norm_`` iterates a set of parameters: its last digits vary);
    DTensor gradients may live on different meshes (experts vs the rest), so their norms are made whole
    one by one."""
    params = [p for p in model.parameters() if p.grad is not None]
    fsdp1 = is_fsdp1(model)
    dtensors = any(_is_dtensor(p.grad) for p in params)
    if not fsdp1 and not dtensors:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad.detach() for p in params]
    norms = _float32_norms(grads)
    # The squares summed one after the other in parameter order, on the device: a cumulative sum is
    # that sum (sequential on the CPU, so the same digits as a loop; a fixed scan on CUDA), where
    # .sum() would add them pairwise.
    squares = torch.cumsum(torch.stack(norms).double() ** 2, 0)[-1] if norms else torch.zeros((), dtype=torch.float64)
    if fsdp1:  # each rank holds its shards of every gradient
        squares = all_reduce_sum(squares)
    total = float(squares.sqrt())  # the one read-back of the step's clipping
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        with torch.no_grad():
            if dtensors:  # on several meshes (experts vs the rest): one at a time
                for p in params:
                    p.grad.mul_(coef)
            else:
                torch._foreach_mul_(grads, coef)
    return total


def _float32_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's whole 2-norm in float32, on the device: one foreach kernel for float32 gradients
    (torch 2.3's takes no dtype), else one norm at a time (DTensors: made whole one by one, as their
    meshes may differ)."""
    if any(_is_dtensor(g) or g.dtype != torch.float32 for g in grads):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        return [n.full_tensor() if _is_dtensor(n) else n for n in norms]
    return list(torch._foreach_norm(grads))


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by its name in the unwrapped model (a gather: tests, debugging)."""
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, with_grads=True, writeback=False):
            return {clean_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[clean_name(name)] = (
                p.grad.full_tensor().detach().clone() if _is_dtensor(p.grad) else p.grad.detach().clone()
            )
    return out


# --------------------------------------------------------------------------- checkpoints


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
    on_cpu = next(model.parameters()).device.type == "cpu"
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


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters. FSDP2 keeps the root unit gathered after a forward pass
    (the backward pass needs it at once): after a forward without backward (evaluation) the model's
    registered parameters are the gathered ones, which the optimizer does not know, and a state dict of them
    would be whole tensors. A no-op for other layouts."""
    if not fsdp2_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class StatePieces:
    """This rank's pieces of the training state (``moeflow.checkpoint_storage.Piece``: a contiguous range of
    each tensor's flattened elements, a view of the rank's own storage), keyed by the unwrapped model's
    names (a tied parameter by its first name): ``model`` every parameter and persistent buffer,
    ``optimizer`` ``{name: {state key: piece}}`` for the optimizer's tensors; ``scalars`` its state values
    that are not tensors (``{name: {key: value}}``) and ``param_groups`` its groups (parameter names for
    the parameters)."""

    model: dict[str, Piece]
    optimizer: dict[str, dict[str, Piece]]
    scalars: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]]


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
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
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
    if not _is_dtensor(value):
        return Piece(value.detach().view(-1), 0, shape)
    local, offsets = _local_pieces(value)[0]
    if any(offsets[1:]) or tuple(local.shape[1:]) != shape[1:]:
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
