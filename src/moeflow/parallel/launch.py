"""The torchrun command a training rule starts its script with: CPU ranks, GPUs on one node, or one agent
per node of a SLURM allocation.
"""

from __future__ import annotations

from moeflow.plan.scaleout import ScaleoutError


def torchrun_command(python: str, gpus: int = 0, nodes: int = 1, cpu_ranks: int = 1, port: int = 29500) -> str:
    """The launcher a training rule's shell command puts before its script: one rank per GPU of the rule's
    ``resources.gpu`` (split over ``resources.nodes``), or ``cpu_ranks`` gloo ranks without GPUs.

    One node: torchrun ``--standalone``. Several nodes (SLURM): ``srun`` starts one torchrun per node in
    the job's allocation (``--overlap``: inside the job step the executor plugin runs the rule in), which
    meet at a c10d rendezvous on the first node."""
    if gpus and gpus % nodes:
        raise ScaleoutError(f"{gpus} GPUs do not split evenly over {nodes} nodes")
    per_node = gpus // nodes if gpus else cpu_ranks
    run = f"{python} -m torch.distributed.run --monitor-interval 0.5 --nproc_per_node {per_node}"
    if nodes == 1:
        return run.replace(" -m torch.distributed.run ", " -m torch.distributed.run --standalone ")
    head = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    return (
        f"srun --overlap --nodes {nodes} --ntasks-per-node 1 {run} --nnodes {nodes} "
        f'--rdzv-backend c10d --rdzv-endpoint {head}:{port} --rdzv-id "$SLURM_JOB_ID"'
    )
