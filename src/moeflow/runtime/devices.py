"""Each local job's own GPUs, claimed with one lock per GPU before it touches CUDA.

A job that declares ``resources.gpu = N`` (every GPU rule, from its config: workflow/rules/common.smk's
``gpus_of``) claims N distinct GPUs of the machine before it touches CUDA, and sees only those
(``CUDA_VISIBLE_DEVICES``).

Snakemake's ``--resources gpu=N`` keeps the GPU jobs that run at once within N GPUs, but it does not say
which GPUs a job gets: without this, every job would start on ``cuda:0``. A claim is an exclusive ``flock`` on
one file per GPU in a lock folder (:data:`LOCK_DIR_ENV`, else one per user and SLURM job under the temporary
folder), held until the job's process exits (also when it is killed: the kernel drops the locks). A job that
finds too few GPUs free waits (without ``--resources gpu=N`` the locks alone keep jobs off each other's GPUs).

The GPUs are those the job can see: ``CUDA_VISIBLE_DEVICES`` if set (a SLURM allocation sets it), else the
machine's (``nvidia-smi -L``, or the ``/dev/nvidia<N>`` device files). Inside a SLURM job the folder is that
job's own, so a job of the SLURM executor claims its whole allocation at once and never waits, while local jobs
of one ``salloc`` share the allocation's GPUs without overlap.

Standard library only: the launcher of the training rules (``python -m moeflow.runtime.devices --gpus N --
torchrun ...``) runs it before torch is imported.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("moeflow")


LOCK_DIR_ENV = "MOEFLOW_GPU_LOCK_DIR"


VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


_held: list[int] = []  # the open lock files of this process's claim: kept open until the process exits


class DeviceError(RuntimeError):
    """A job asks for more GPUs than it can see."""


def lock_dir() -> Path:
    """Where the GPUs' lock files live: :data:`LOCK_DIR_ENV`, else one folder per user (and SLURM job)."""
    if os.environ.get(LOCK_DIR_ENV):
        return Path(os.environ[LOCK_DIR_ENV])
    scope = os.environ.get("SLURM_JOB_ID", "local")
    return Path(tempfile.gettempdir()) / f"moeflow-gpus-{os.getuid()}-{scope}"


def visible_devices() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs)."""
    if VISIBLE_ENV in os.environ:
        return [d.strip() for d in os.environ[VISIBLE_ENV].split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
        return [str(i) for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]
    except (OSError, subprocess.SubprocessError):
        pass
    files = [p.name for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return sorted((name.removeprefix("nvidia") for name in files), key=int)


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim(count: int, *, what: str = "this job", poll_s: float = 0.5, timeout_s: float | None = None) -> list[str]:
    """Claim ``count`` GPUs no other moeflow job holds, and make them this process's (and its children's)
    only ones (``CUDA_VISIBLE_DEVICES``); the claim lasts until the process exits. Waits while too few are
    free (``timeout_s``: then a DeviceError). ``count`` 0: nothing is claimed or changed."""
    if count <= 0:
        return []
    if "torch" in sys.modules:
        # CUDA takes CUDA_VISIBLE_DEVICES at the first device query (transformers' import makes one): a claim
        # after that would lock GPUs the process does not use, and it would run on cuda:0 beside another job.
        raise DeviceError(
            f"{what} claims its {count} GPU(s) after torch was imported: claim first (moeflow.runtime.stage's "
            "Stage.start before any import of torch, or the launcher prefix claim_command)"
        )
    devices = visible_devices()
    if len(devices) < count:
        raise DeviceError(
            f"{what} asks for {count} GPU(s) (its rule's resources.gpu, from the config's parallel section and "
            f"hardware.device: cuda) but this machine shows {len(devices)} ({VISIBLE_ENV}="
            f"{os.environ.get(VISIBLE_ENV, '<unset>')}): lower parallel.nproc_per_node, or run where it has them"
        )
    folder = lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    waited = False
    while True:
        got: list[tuple[str, int]] = []
        for device in devices:
            fd = _try_lock(folder / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}.lock")
            if fd is not None:
                got.append((device, fd))
                if len(got) == count:
                    break
        if len(got) == count:
            for _, fd in got:
                os.set_inheritable(fd, True)  # held across exec (the launcher becomes torchrun)
                _held.append(fd)
            chosen = [device for device, _ in got]
            os.environ[VISIBLE_ENV] = ",".join(chosen)
            log.info("%s: GPUs %s (of %s)", what, ",".join(chosen), ",".join(devices))
            return chosen
        for _, fd in got:  # all or nothing: two jobs holding half each would wait for ever
            os.close(fd)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise DeviceError(f"{what}: {count} of the GPUs {','.join(devices)} did not come free in {timeout_s} s")
        if not waited:
            log.info("%s: waiting for %d free GPU(s) of %s (lock folder %s)", what, count, ",".join(devices), folder)
            waited = True
        time.sleep(poll_s)


def claim_command(python: str, gpus: int, what: str) -> str:
    """The shell words that run the command after them on ``gpus`` claimed GPUs (:func:`main`); empty for 0."""
    if gpus <= 0:
        return ""
    return f"{python} -m moeflow.runtime.devices --gpus {gpus} --what {shlex.quote(what)} -- "


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m moeflow.runtime.devices --gpus N [--what NAME] -- COMMAND...``: claim N GPUs, then become
    COMMAND (which keeps the claim until it exits)."""
    parser = argparse.ArgumentParser(description="run a command on GPUs no other moeflow job holds")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--what", default="the job")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        claim(args.gpus, what=args.what)
    except DeviceError as exc:
        sys.exit(f"moeflow: {exc}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
