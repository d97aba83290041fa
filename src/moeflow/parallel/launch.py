"""The command a torchrun rule starts its script with.

The torchrun rules are training, coverage and evaluation. The command is the interpreter alone for one rank on one
node, torchrun for CPU ranks or GPUs on one node, or one torchrun agent per node of a SLURM allocation.
"""

from __future__ import annotations


class LaunchError(ValueError):
    """A launch the job's resources cannot make, with what to change."""


# The job's nodes. snakemake-executor-plugin-slurm's jobstep runs the rule's command with every SLURM_*
# variable but SLURM_JOB_ID removed, so SLURM_JOB_NODELIST is usually missing: squeue knows the job's nodes.
JOB_NODES = '"${SLURM_JOB_NODELIST:-$(squeue --noheader --jobs "$SLURM_JOB_ID" --format %N)}"'


def torchrun_command(
    python: str, gpus: int = 0, nodes: int = 1, cpu_ranks: int = 1, port: int = 29500, threads: int = 1
) -> str:
    """The launcher a torchrun rule's shell command puts before its script: one rank per GPU of the rule's
    ``resources.gpu`` (split over ``resources.nodes``), or ``cpu_ranks`` gloo ranks without GPUs.

    One rank on one node: ``python`` alone. The script reads its place from torchrun's variables with
    one-process defaults (moeflow.parallel.process_group.init), and a torchrun agent would only add an
    interpreter's start (about 3.5 CPU s, a tenth of a smoke job) and a process between Snakemake and the rank.
    Several ranks on one node: torchrun ``--standalone``. Several nodes (SLURM, the rule run in the batch step: ``mpi``
    in the profile): ``srun`` starts one torchrun per node of the job's allocation (``--overlap``: beside
    the batch step), each with the rule's ``threads`` CPUs and its node's GPUs (``--gpus-per-node``: a step
    started from the jobstep's environment sees none otherwise); they meet at a c10d rendezvous on the
    first node."""
    if gpus and gpus % nodes:
        raise LaunchError(f"{gpus} GPUs do not split evenly over {nodes} nodes")
    per_node = gpus // nodes if gpus else cpu_ranks
    if per_node == 1 and nodes == 1:
        return python
    run = f"{python} -m torch.distributed.run --monitor-interval 0.5 --nproc_per_node {per_node}"
    if nodes == 1:
        return run.replace(" -m torch.distributed.run ", " -m torch.distributed.run --standalone ")
    step = f"srun --overlap --nodes {nodes} --ntasks-per-node 1 --cpus-per-task {threads}"
    if gpus:
        step += f" --gpus-per-node {per_node}"
    head = f'"$(scontrol show hostnames {JOB_NODES} | head -n 1)"'
    return f'{step} {run} --nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint {head}:{port} --rdzv-id "$SLURM_JOB_ID"'
