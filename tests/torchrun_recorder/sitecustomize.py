"""torchrun replaced by a recorder, for the SLURM tests on emulated GPU nodes (tests/pipeline/test_slurm.py).

Python imports ``sitecustomize`` at start-up from the first folder on ``PYTHONPATH`` that has one; with this
folder there, ``python -m torch.distributed.run ...`` (moeflow's launcher) records instead of starting ranks,
since the emulated nodes' GPUs are device files that compute nothing. Every agent prints one line to the job's
output: ``torchrun-recorder {"argv": torchrun's arguments, "env": what SLURM gave it}``, then makes the training
rule's declared outputs (from the script's ``--job``), as its rank 0 would, so the job ends like a real one.
Every other interpreter started with this folder on its path runs as usual.
"""

import json
import os
import sys

ENV = (
    "SLURMD_NODENAME",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_NODES",
    "SLURM_CPUS_PER_TASK",
    "SLURM_GPUS_ON_NODE",
    "CUDA_VISIBLE_DEVICES",
)


def record(args: list[str]) -> None:
    script = next(i for i, arg in enumerate(args) if arg.endswith(".py"))
    line = {"torchrun": args[:script], "script": args[script], "env": {k: os.environ.get(k) for k in ENV}}
    sys.stdout.write("torchrun-recorder " + json.dumps(line) + "\n")  # one short line: srun splits long ones
    if "--job" in args:
        job = json.loads(args[args.index("--job") + 1])
        for path in job["output"].values():
            os.makedirs(path, exist_ok=True)
    if "--log-file" in args:
        with open(args[args.index("--log-file") + 1], "a") as log:
            log.write("torchrun-recorder: recorded, no ranks started\n")


if getattr(sys, "orig_argv", [])[1:3] == ["-m", "torch.distributed.run"]:
    record(sys.orig_argv[3:])
    sys.stdout.flush()
    os._exit(0)
