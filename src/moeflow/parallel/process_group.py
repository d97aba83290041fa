"""The process group torchrun describes, this rank's place and device, and the collectives used.

The group is made from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``: gloo on CPU, nccl on CUDA (and gloo for CPU
tensors; across nodes on the interface :func:`gloo_socket_ifname` picks), nothing at all in one process
(:func:`init` / :func:`teardown`, or the :func:`process_group` context). This rank's place and device are a
:class:`Ranks`; the collectives are the few the library uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.model.device import compute_device
from moeflow.parallel.settings import ParallelSettings

log = logging.getLogger("moeflow.parallel.process_group")


class DistributedError(RuntimeError):
    """A layout that cannot run here, naming the setting and what to do."""


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
            "config's parallel section agree (moeflow.workflow.scaleout.request_problems lists the differences)"
        )
    return parallel


def gloo_socket_ifname(environ: Mapping[str, str], interfaces: Sequence[str]) -> str | None:
    """The network interface gloo binds to across nodes: ``GLOO_SOCKET_IFNAME`` as the launch environment sets
    it, else the first of this node's ``interfaces`` that ``NCCL_SOCKET_IFNAME`` selects (NCCL's syntax:
    name prefixes, ``=`` exact names, ``^`` names to exclude, comma-separated; never the loopback); None
    when neither says. Without one gloo binds to the address the host name resolves to, often a loopback
    or a management network the other nodes cannot reach, and the ranks hang in their first CPU collective."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return environ["GLOO_SOCKET_IFNAME"]
    spec = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if not spec:
        return None
    exact, exclude = spec.startswith("="), spec.startswith("^")
    names = [n for n in spec.lstrip("=^").split(",") if n]
    for interface in interfaces:
        if interface.startswith("lo"):
            continue
        if exact:
            chosen = interface in names
        elif exclude:
            chosen = not any(interface.startswith(n) for n in names)
        else:
            chosen = any(interface.startswith(n) for n in names)
        if chosen:
            return interface
    return None


def _set_gloo_interface() -> None:
    """Across nodes: ``GLOO_SOCKET_IFNAME`` from :func:`gloo_socket_ifname`, or a warning naming it."""
    import socket

    if int(os.environ.get("WORLD_SIZE", "1")) <= int(
        os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    ):
        return  # one node: gloo's default (the host name's address) reaches every rank
    interface = gloo_socket_ifname(os.environ, [name for _, name in socket.if_nameindex()])
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    else:
        log.warning(
            "ranks on several nodes and neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME selects a network "
            "interface: gloo binds to the host name's address; if the ranks hang at the start, export "
            "NCCL_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) = the interface the nodes reach each other on "
            "(docs/scaling-out.md)"
        )


def init(device_type: str | None = None, group_of_one: bool = False) -> Ranks:
    """Join the process group torchrun describes (only with more than one process, or ``group_of_one``) and pick
    the device.

    ``device_type``: "cuda" or "cpu"; default: CUDA when available. The backend follows the device:
    nccl for CUDA tensors (and gloo for CPU ones) on CUDA, gloo on CPU. ``group_of_one``: one process joins a group
    of its own (FSDP2 shards over a device mesh, which needs one: ``parallel.cpu_offload`` on one rank), in memory
    when no torchrun agent started it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = compute_device(device_type)  # refuses CUDA without a GPU; TF32 on for CUDA
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if world > 1 or group_of_one:
        import torch.distributed as dist

        if not dist.is_initialized():
            _set_gloo_interface()
            # With CUDA, nccl for the model's tensors and gloo for the CPU tensors the losses all-reduce
            # (token and expert counts, logged loss terms).
            backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
            if world == 1 and "MASTER_ADDR" not in os.environ:  # started without torchrun (moeflow.parallel.launch)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group(backend)
    return Ranks(rank, world, local_rank, device)


def teardown() -> None:
    """Leave the process group (all ranks together), if one was joined."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy()


# How long the main thread, its GIL released, lets gloo's workers drop what they hold before the group goes
_GLOO_SETTLE_S = 0.2


def destroy() -> None:
    """``destroy_process_group`` once gloo's worker threads have dropped the last collective's tensors. A
    worker that still holds the last reference to a tensor Python made (``broadcast_object_list``'s,
    ``all_gather_object``'s, a barrier's) must take the GIL to free it:
    - torch before 2.8 (pytorch#154976): the group's destructor holds the GIL while it joins the workers, and
      both wait forever (3 of 18 two-rank runs hung so on a loaded 2-core machine, on the pinned stack);
    - every torch: a rank that leaves right after is finalizing the interpreter by then, and a thread that takes
      the GIL during finalization is ended, which in C++ is ``terminate called without an active exception``
      (SIGABRT: 3 of 68 two-rank bf16 FSDP runs of tests/unit/test_distributed.py on the current stack, 0 of
      100 with the settle).
    A garbage collection and a moment with the GIL released let the workers finish first. No barrier: safe
    in a rank's error path."""
    import gc
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    time.sleep(_GLOO_SETTLE_S)
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


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` (picklable), in rank order, on the main rank and None on the others (what only the
    main rank writes: one copy in host memory, not one per rank); ``[obj]`` in one process."""
    import torch.distributed as dist

    if not _initialized():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` itself in one process."""
    import torch.distributed as dist

    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_floats(value: float) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` in one process): one small all-reduce,
    through gloo where the backend has it (no device sync), else on the collective device."""
    import torch.distributed as dist

    if not _initialized():
        return [float(value)]
    device = torch.device("cpu") if "gloo" in str(dist.get_backend()).lower() else collective_device()
    values = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    values[dist.get_rank()] = value
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values.tolist()


# The integer dtypes NCCL reduces (ncclInt8/Uint8/Int32/Uint32/Int64/Uint64): no 16-bit integers.
NCCL_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64)


def exact_sum_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as integers that gloo and NCCL both sum, for a sum in which each element comes from
    one rank and the others add zeros: the same bits back, a negative zero's sign and a NaN's payload too.
    8- and 4-byte elements as int64/int32; other widths as their bytes (uint8: NCCL has no int16 for a
    2-byte bf16/fp16 master, and a byte adds to zero bytes without a carry)."""
    bits = {8: torch.int64, 4: torch.int32}.get(tensor.element_size(), torch.uint8)
    return tensor.view(bits)


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum a tensor over ranks in place (over ``group``, default all ranks; a no-op in one process)."""
    if world_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def collective_device(group: Any = None) -> torch.device:
    """The device of the tensors a collective on ``group`` (default all ranks) runs on where the ranks'
    tensors live: this rank's CUDA device where the group's backend has NCCL (``cpu:gloo,cuda:nccl``
    included: a CPU tensor there goes through gloo while the other ranks' CUDA tensors go through NCCL, and
    the collective never completes), else the CPU. A rank that builds a tensor of its own for a collective
    (a zero for gradients it does not hold) builds it here."""
    import torch.distributed as dist

    if not _initialized() or "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
