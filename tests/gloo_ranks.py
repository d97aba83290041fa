"""Run a function on several ranks in spawned processes and collect what they report: what the unit tests of
collectives (gloo process groups) share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def run_ranks(fn: Callable[..., None], *args: Any, nprocs: int = 2, timeout_s: float = 600.0) -> dict:
    """``fn(rank, *args, results)`` on ``nprocs`` spawned ranks; ``results`` (a shared dict each rank fills) as a
    plain dict. The dict's manager is a spawned process too: a manager forked from the pytest process, which holds
    the threads of earlier tests, can deadlock in the fork, and a rank writing to it then waits forever (on the
    pinned stack one hung for 53 minutes). Ranks still running after ``timeout_s`` are killed and the test fails."""
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        ranks = mp.spawn(fn, args=(*args, results), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        while not ranks.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in ranks.processes:
                    process.kill()
                raise AssertionError(f"{fn.__name__} on {nprocs} ranks still ran after {timeout_s:.0f} s: killed")
        return dict(results)
