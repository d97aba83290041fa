"""Run an untrusted Python program isolated from the pipeline, and many of them in parallel.

Nothing here runs the program in this process. Each run gets:

- its own interpreter, ``python -I -B -S`` (isolated: no PYTHON* variables, no script folder on ``sys.path``;
  no bytecode written; the standard library only, no site-packages), started through
  ``moeflow.evaluation.sandbox_launcher``, which sets the resource limits (CPU seconds, address space, file size, no
  new processes) and the audit hook that ends the program when it starts a process, writes outside its
  folder, opens a socket or reaches past the hook;
- a fresh temporary working folder, removed afterwards with everything in it; the program's source and its
  captured stdout/stderr lie beside that folder, not in it;
- a cleaned environment: PATH and LANG, with HOME and TMPDIR the working folder;
- its own session (process group), killed whole at the wall-clock limit and again after it exits;
- where ``unshare`` can make them (unprivileged user namespaces, or root), new network and PID namespaces:
  no interface but a down loopback, and every process it could start dies with it. Elsewhere the audit
  hook alone refuses sockets (:func:`namespaces_available` says which, :attr:`Outcome.isolation` records it),
  and a process started past the hook (which takes code written to defeat it) could outlive the run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moeflow.evaluation import sandbox_launcher
from moeflow.runtime.stage import progress

LAUNCHER = Path(sandbox_launcher.__file__).resolve()


ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


UNSHARE = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]


REFUSALS = {code: kind for kind, code in sandbox_launcher.EXIT_CODES.items()}


# What a run ended as: ok (exit 0), error (another exit code), timeout (wall clock), cpu_limit (SIGXCPU),
# output_limit (stdout or stderr reached the file-size limit), killed (another signal), or a refusal.
STATUSES = ("ok", "error", "timeout", "cpu_limit", "output_limit", "killed", *sandbox_launcher.EXIT_CODES)


@dataclass(frozen=True)
class Limits:
    """The bounds of one run."""

    wall_s: float = 5.0
    cpu_limit_s: int | None = None  # None: wall_s rounded up
    memory_mb: int = 512
    file_size_mb: int = 16
    keep_output_bytes: int = 4096  # the tail of stdout and of stderr kept in the outcome

    @property
    def cpu_s(self) -> int:
        return self.cpu_limit_s or max(1, math.ceil(self.wall_s))


@dataclass(frozen=True)
class Outcome:
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: str  # "namespaces" or "audit_hook"


@functools.cache
def namespaces_available() -> bool:
    """Whether ``unshare`` can give a program new user, network and PID namespaces here (tried once)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        probe = subprocess.run([unshare, *UNSHARE, "true"], capture_output=True, timeout=30, env=ENV)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def command(limits: Limits, program_file: Path, namespaces: bool) -> list[str]:
    python = [sys.executable, "-I", "-B", "-S", str(LAUNCHER), json.dumps(limits_record(limits)), str(program_file)]
    return [shutil.which("unshare") or "unshare", *UNSHARE, *python] if namespaces else python


def limits_record(limits: Limits) -> dict[str, int]:
    """What the launcher sets (moeflow.evaluation.sandbox_launcher.set_limits)."""
    return {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb}


def run(source: str, limits: Limits = Limits(), namespaces: bool | None = None) -> Outcome:
    """Run the program ``source`` in the sandbox and say how it ended. ``namespaces`` None: where
    :func:`namespaces_available`; False: the audit hook only (tests compare both)."""
    namespaces = namespaces_available() if namespaces is None else namespaces
    scratch = Path(tempfile.mkdtemp(prefix="moeflow-sandbox-"))
    try:
        work = scratch / "work"
        work.mkdir()
        program_file = scratch / "program.py"
        program_file.write_text(source, encoding="utf-8")
        with open(scratch / "stdout", "wb+") as out, open(scratch / "stderr", "wb+") as err:
            start = time.monotonic()
            proc = subprocess.Popen(
                command(limits, program_file, namespaces),
                cwd=work,
                env={**ENV, "HOME": str(work), "TMPDIR": str(work)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            try:
                returncode: int | None = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                returncode = None
            _kill_group(proc.pid)  # at the limit; after an exit, whatever it left running
            proc.wait()
            seconds = time.monotonic() - start
            stdout, stdout_full = _tail(out, limits)
            stderr, stderr_full = _tail(err, limits)
    finally:
        _remove(scratch)
    return Outcome(
        status=_status(returncode, stdout_full or stderr_full, namespaces),
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        seconds=seconds,
        isolation="namespaces" if namespaces else "audit_hook",
    )


def run_many(
    sources: Sequence[str],
    limits: Limits = Limits(),
    threads: int = 1,
    desc: str = "sandbox",
    namespaces: bool | None = None,
) -> list[Outcome]:
    """:func:`run` for each program, ``threads`` at a time, in the order given, with a progress bar."""
    with ThreadPoolExecutor(max_workers=max(1, int(threads))) as pool:
        futures = [pool.submit(run, source, limits, namespaces) for source in sources]
        return [future.result() for future in progress(futures, total=len(futures), desc=desc)]


def _status(returncode: int | None, output_full: bool, namespaces: bool) -> str:
    if returncode is None:
        return "timeout"
    if returncode in REFUSALS:
        return REFUSALS[returncode]
    if output_full:
        return "output_limit"
    if returncode == 0:
        return "ok"
    # a signal: a negative code, or 128 + N from the PID namespace's init (moeflow.evaluation.sandbox_launcher)
    signum = -returncode if returncode < 0 else returncode - 128 if namespaces and returncode > 128 else None
    if signum in (signal.SIGXCPU, signal.SIGKILL):  # the soft and the hard CPU limit
        return "cpu_limit"
    return "error" if signum is None else "killed"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty


def _tail(fh, limits: Limits) -> tuple[str, bool]:
    """The last ``keep_output_bytes`` of a captured stream, and whether it reached the file-size limit."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(max(0, size - limits.keep_output_bytes))
    return fh.read().decode("utf-8", "replace"), size >= limits.file_size_mb << 20


def _remove(folder: Path) -> None:
    """Remove a run's folder, even where the program took the permissions off what it made."""

    def writable_again(function, path, _exc_info):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path):
            os.chmod(path, 0o700)
        function(path)

    shutil.rmtree(folder, onerror=writable_again)
