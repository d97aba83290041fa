"""verify_env's all-reduce probe, run as ``python -m moeflow.runtime.all_reduce_probe [--backend nccl|gloo]``.

One process per GPU (``torch.multiprocessing.spawn``), each all-reduces a 1; the sum must be the process
count. The worker is a function of this importable module: a spawned child re-imports the function it runs by
its module's name, which a ``python -c`` program has none of (the child fails to unpickle ``__main__.rank``).
``--backend gloo --world N`` runs the same code path on CPU processes (the unit test does).
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(index: int, world: int, port: int, backend: str) -> None:
    """One spawned process: join the group, all-reduce a 1, check the sum."""
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(index)
        device = "cuda"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    try:
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        if device == "cuda":
            torch.cuda.synchronize()
        if int(value.item()) != world:
            raise RuntimeError(f"rank {index}: all-reduce gave {value.item()}, want {world}")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend: str, world: int) -> str:
    """Spawn ``world`` processes that all-reduce over ``backend``; the line the probe prints on success."""
    mp.spawn(rank, args=(world, free_port(), backend), nprocs=world, join=True)
    return f"all-reduce over {world} {'GPU(s)' if backend == 'nccl' else 'process(es)'}: ok"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--world", type=int, default=None, help="processes (default: the GPU count)")
    args = parser.parse_args(argv)
    world = args.world if args.world is not None else torch.cuda.device_count()
    print(run(args.backend, world))


if __name__ == "__main__":
    main()
