"""What every stage script shares: threads, seeds, offline mode, logging, provenance, progress.

Every stage script opens the same way, then reads top to bottom::

    job = Job.from_snakemake(snakemake, XStage)  # a script: rule's job, params.settings typed (torchrun: from_argv)
    stage = Stage.start(job)                     # claims its GPUs; sets threads, seeds, HF offline mode, logging
    ...                                          # call the library with job.settings
    write_json(job.output.json, {..., "provenance": stage.provenance()})
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from moeflow.runtime import compat
from moeflow.runtime.devices import claim as claim_gpus
from moeflow.runtime.job import Job

T = TypeVar("T")
log = logging.getLogger("moeflow")


PACKAGE_DIR = Path(__file__).resolve().parents[1]


OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


KILL_ENV = "MOEFLOW_KILL_AT"


# MOEFLOW_KILL_SCOPE=group kills the whole process group (Snakemake too, when a test starts it in its
# own session): what a power cut or `kill -9` of the run leaves behind, incomplete markers included.
# MOEFLOW_KILL_SCOPE=stop freezes the process there (SIGSTOP) for a kill from outside, such as SLURM's
# `scancel --signal=KILL`, at a known point.
KILL_SCOPE_ENV = "MOEFLOW_KILL_SCOPE"


def set_offline() -> None:
    """The pipeline never reaches the network: no hub downloads, no telemetry."""
    os.environ.update(OFFLINE_ENV)


def code_version() -> str:
    """A hash of the moeflow package sources: which code made an output, independent of git."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def torch_version() -> str:
    """``torch.__version__`` (local tag included, e.g. ``2.3.1+cu121``, which the distribution's metadata lacks),
    read from torch/version.py without importing torch: a stage that never uses torch does not pay its import."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    folder = importlib.util.find_spec("torch").submodule_search_locations[0]
    namespace: dict[str, Any] = {}
    exec(compile(Path(folder, "version.py").read_text(encoding="utf-8"), "torch/version.py", "exec"), namespace)
    return namespace["__version__"]


def kill_point(name: str) -> None:
    """Die with SIGKILL here if a test asked for it (``MOEFLOW_KILL_AT=name``): simulates ``kill -9`` of
    this process, or of its whole process group with ``MOEFLOW_KILL_SCOPE=group``; with
    ``MOEFLOW_KILL_SCOPE=stop``, wait here stopped until something else kills it."""
    if os.environ.get(KILL_ENV) == name:
        scope = os.environ.get(KILL_SCOPE_ENV)
        log.warning("%s at %s (%s set)", "stopped" if scope == "stop" else "killed", name, KILL_ENV)
        logging.shutdown()
        if scope == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if scope == "group":
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker has a session of its own: its agent's too
                os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def setup_logging(log_file: str | os.PathLike | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="w", encoding="utf-8"))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers, force=True
    )


def progress(items: Iterable[T], total: int | None = None, desc: str = "", every: float = 10.0) -> Iterator[T]:
    """A tqdm bar on a terminal; plain progress lines (every ``every`` seconds) in a log."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc)
        return
    last = time.monotonic()
    for i, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every:
            log.info("%s: %d%s", desc, i, f"/{total}" if total else "")
            last = now
    log.info("%s: done", desc)


@dataclass
class Stage:
    """The runtime settings of one stage: threads and precision are recorded in its outputs."""

    name: str
    threads: int = 1
    precision: str = "fp32"
    seed: int = 0
    stack: str = "pinned"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_offline()
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if self.threads > 1 else "false"
        self.torch_threads()

    def torch_threads(self) -> int:
        """torch's intra-op threads set to the stage's, if torch is imported: a stage whose library imports it
        imports it before the stage starts; one that imports it later (the planner's meta count) gets them set
        here again when it records its provenance. A stage that never imports torch does not pay its import
        (about 3 s of every small job)."""
        threads = max(1, int(self.threads))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        return threads

    @classmethod
    def start(cls, job: Job | Any) -> Stage:
        """The stage of a job (moeflow.runtime.job.Job, or a ``script:`` rule's ``snakemake`` object): logging to
        its log file, threads from the rule's ``threads:``, stack, precision and seed from ``params.runtime``
        (every rule passes it: common.smk's runtime()). The job's GPUs are claimed here, before anything touches
        CUDA (moeflow.runtime.devices)."""
        job = job if isinstance(job, Job) else Job.from_snakemake(job)
        runtime = job.params.runtime
        setup_logging(job.log_file)
        claim_gpus(job.gpus, what=f"rule {job.rule}")
        stage = cls(
            name=job.rule,
            threads=job.threads,
            precision=runtime["precision"],
            seed=int(runtime["seed"]),
            stack=runtime["stack"],
        )
        log.info("stage %s: threads=%d precision=%s stack=%s", stage.name, stage.threads, stage.precision, stage.stack)
        return stage

    def provenance(self) -> dict[str, Any]:
        """Facts that identify how an output was made. No timestamps: same inputs give the same bytes."""
        return {
            "stage": self.name,
            "moeflow_code": code_version(),
            "stack": self.stack,
            "python": platform.python_version(),
            "torch": torch_version(),
            "transformers": str(compat.version_of("transformers")),
            "threads": self.torch_threads(),
            "precision": self.precision,
            "seed": self.seed,
        }
