"""Run a function on several ranks in spawned processes and collect what they report: what the unit tests of
collectives (gloo process groups) share."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moeflow.runtime import compat


def run_ranks(fn: Callable[..., None], *args: Any, nprocs: int = 2, timeout_s: float = 600.0) -> dict:
    """``fn(rank, *args, results)`` on ``nprocs`` spawned ranks; ``results`` (a shared dict each rank fills) as a
    plain dict. The dict's manager is a spawned process too: a manager forked from the pytest process, which holds
    the threads of earlier tests, can deadlock in the fork. Ranks still running after ``timeout_s`` print every
    thread's Python stack (to the test's captured stderr), are killed, and the test fails."""
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        ranks = mp.spawn(_traced_rank, args=(fn, *args, results), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        while not ranks.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in [p for p in ranks.processes if p.is_alive()]:
                    os.kill(process.pid, signal.SIGUSR1)
                    time.sleep(1)  # one rank's stack at a time: they share the stderr
                for process in ranks.processes:
                    process.kill()
                raise AssertionError(
                    f"{fn.__name__} on {nprocs} ranks still ran after {timeout_s:.0f} s: killed "
                    f"(their stacks: the captured stderr)"
                )
        return dict(results)


def _traced_rank(rank: int, fn: Callable[..., None], *args: Any) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn(rank, *args)


@contextlib.contextmanager
def gloo_group(rank: int, root: str, world_size: int = 2, timeout_s: float = 90.0) -> Iterator[Any]:
    """In a rank of :func:`run_ranks`: join a gloo group of ``world_size`` from a file in ``root`` (a wrong
    collective fails after ``timeout_s`` instead of gloo's default half hour), yield this rank's CPU ``Ranks``,
    and leave the group with ``moeflow.parallel.process_group.destroy`` (never ``destroy_process_group`` itself:
    docs/testing.md)."""
    import datetime

    import torch
    import torch.distributed as dist

    from moeflow.parallel.process_group import Ranks, destroy

    dist.init_process_group(
        "gloo",
        init_method=f"file://{root}/init",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield Ranks(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    finally:
        destroy()


def sharded_layout(ranks: Any, parallel: dict | None = None) -> Any:
    """The layout of ``parallel`` (a ``parallel`` config section; default ``strategy: fsdp``) over ``ranks``
    (one node)."""
    from moeflow.loading.factory import Layout
    from moeflow.parallel.settings import ParallelSettings
    from moeflow.settings import typed

    section = {"strategy": "fsdp", **(parallel or {}), "nproc_per_node": ranks.world_size}
    return Layout(ranks, typed(ParallelSettings, section))


def fsdp_layout(ranks: Any) -> Any:
    """The ``parallel.strategy: fsdp`` layout over ``ranks`` (one node)."""
    return sharded_layout(ranks)


# The sharded layouts of two ranks a test of a training method runs in (``parallel`` sections): FSDP (FSDP2 on the
# current stack, FSDP1 on the pinned one) and transformers' expert parallelism (transformers 5 only).
SHARDED_LAYOUTS = [
    pytest.param({"strategy": "fsdp"}, id="fsdp"),
    pytest.param(
        {"strategy": "ep", "ep_size": 2, "fsdp_size": 2},
        id="ep",
        marks=pytest.mark.skipif(not compat.is_transformers_v5(), reason="expert parallelism needs transformers 5"),
    ),
]
