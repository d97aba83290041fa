"""A phase's peak memory on this rank, to set beside the memory planner's figure for it (moeflow.plan.memory).

On CUDA the allocator's peak (``torch.cuda.max_memory_allocated``, reset before the phase): what the planner's device
side counts but its runtime (the CUDA context and the communication buffers, which the allocator never sees).

On CPU the process's resident set high-water mark (``VmHWM``, reset before the phase by writing 5 to
``/proc/self/clear_refs``, Linux) less its file-backed pages at the phase's end (``RssFile`` and ``RssShmem``: the
shared libraries' code, memory-mapped files). Those pages are clean, the kernel drops them under pressure, and their
count depends on how the files were cached, not on the job: the same imports hold 140 MiB of them from a venv
installed long ago and 230 MiB from one installed a minute before (large page-cache folios), which alone moved a
smoke run's phases by 20%. What remains is the rank's own memory, the planner's whole figure for a CPU rank. Where
the mark cannot be reset (not Linux), a phase's figure is the resident set at its end, a lower bound, rather than
the peak of an earlier, larger phase.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # torch is imported where CUDA is asked: the report card (the Snakefile) reads PHASE_PEAKS_FILE
    import torch

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
# in the run's train logs, train_model's {"device", "stages": {stage: by_phase(...)}}; in warmup's checkpoint
# {"device", "bytes": by_phase(...)}
PHASE_PEAKS_FILE = "phase_peaks.json"
RESET_HIGH_WATER_MARK = "5"  # proc(5): "Reset the peak resident set size ("high water mark") to the process's RSS"


def reset_peak(device: torch.device) -> bool:
    """Start a phase: reset the peak; False where it cannot be reset."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        CLEAR_REFS.write_text(RESET_HIGH_WATER_MARK)
    except OSError:
        return False
    return True


def peak_bytes(device: torch.device, reset: bool = True) -> int:
    """The peak since :func:`reset_peak` (CUDA: allocated bytes; CPU: the resident set's high-water mark less its
    file-backed pages, or where it was not ``reset`` the resident set now)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device)
    if not reset:
        return psutil.Process().memory_info().rss
    status = dict(line.split(":", 1) for line in STATUS.read_text().splitlines() if ":" in line)
    kib = {key: int(status[key].split()[0]) for key in ("VmHWM", "RssFile", "RssShmem") if key in status}
    if "VmHWM" not in kib:  # a kernel that reports no high-water mark: the resident set now
        return psutil.Process().memory_info().rss
    return (kib["VmHWM"] - kib.get("RssFile", 0) - kib.get("RssShmem", 0)) * 1024


def release_freed_memory() -> None:
    """Give the host memory the process has freed back to the system (glibc's ``malloc_trim``; nothing elsewhere).
    glibc keeps freed heap memory resident: after a step a CPU rank would hold its activations' room through the
    checkpoint and the export that follow, which do not need it, as resident set the host cannot use. Cheap where
    called (before a checkpoint, before the export), not per step, where the next step would fault it back in."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` from the symbols already loaded (None elsewhere: macOS, musl)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class PhasePeaks:
    """Each phase's peak on this rank, the largest over the phase's runs (a step is run many times):
    ``{phase: bytes}`` in :attr:`bytes`, the last run's in :attr:`last`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: dict[str, int] = {}
        self.last = 0

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        reset = reset_peak(self.device)
        yield
        self.last = peak_bytes(self.device, reset)
        self.bytes[phase] = max(self.bytes.get(phase, 0), self.last)


def by_phase(per_rank: Sequence[Mapping[str, int]]) -> dict[str, list[int]]:
    """Every rank's :attr:`PhasePeaks.bytes` (gathered, rank order) as ``{phase: [bytes per rank]}``."""
    phases = dict.fromkeys(phase for peaks in per_rank for phase in peaks)
    return {phase: [peaks[phase] for peaks in per_rank] for phase in phases}
