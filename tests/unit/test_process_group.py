"""Leaving the process group: :func:`moeflow.parallel.process_group.destroy` never deadlocks with gloo's workers.

Before torch 2.8 the group's destructor holds the GIL while it joins gloo's worker threads; a worker still
dropping the last reference to a tensor that ``broadcast_object_list`` or ``all_gather_object`` made waits for
that GIL, and the rank hangs at the end of its stage (on the pinned stack, 3 of 18 runs of a two-rank test on a
loaded 2-core machine). The test leaves the group right after those collectives, many times over."""

from __future__ import annotations

from pathlib import Path

from gloo_ranks import run_ranks

CYCLES = 40


def _join_gather_leave(rank: int, root: str, results: dict) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.parallel.process_group import broadcast_object, destroy, gather_objects

    torch.set_num_threads(1)
    for cycle in range(CYCLES):
        dist.init_process_group("gloo", init_method=f"file://{Path(root) / f'init-{cycle}'}", rank=rank, world_size=2)
        try:
            assert broadcast_object({"cycle": cycle} if rank == 0 else None) == {"cycle": cycle}
            assert gather_objects(rank) == [0, 1]
        finally:
            destroy()
        results[rank] = cycle + 1


def test_ranks_leave_the_group_right_after_object_collectives_every_time(tmp_path):
    assert run_ranks(_join_gather_leave, str(tmp_path), timeout_s=240) == {0: CYCLES, 1: CYCLES}
