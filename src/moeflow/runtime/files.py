"""Atomic, deterministic file output.

A stage never leaves a half-written file or folder under its final name: everything is written to a
temporary sibling and renamed into place only once complete. JSON is written with sorted keys so
that the same content gives the same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DiskFull(OSError):
    """A write that ran out of space (or quota), naming the output it was writing; the output's previous
    version, if any, is left as it was."""


_NO_SPACE = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}


def disk_full_error(exc: BaseException, path: Path) -> DiskFull | None:
    """``exc`` as a DiskFull that names ``path`` (the final output), or None if it is not about space."""
    if not isinstance(exc, OSError) or exc.errno not in _NO_SPACE:
        return None
    cause = exc.__cause__ if isinstance(exc, DiskFull) and exc.__cause__ is not None else exc
    detail = getattr(cause, "filename", None)
    where = f" (at {detail})" if detail and str(detail) != str(path) else ""
    kept = "its previous version is unchanged" if path.exists() else "nothing was written under that name"
    return DiskFull(
        exc.errno,
        f"{_NO_SPACE[exc.errno]} while writing {path}{where}: {kept}. Free space on that filesystem "
        f"(df -h {path.parent}) and rerun",
    )


def _temporary_prefix(path: Path) -> str:
    """Temporaries are named after their writer (host and process), so a later writer can tell one left
    behind by a killed process from one still being written."""
    return f".{path.name}.{socket.gethostname()}-{os.getpid()}."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of ``path`` that a killed writer on this host left behind (a killed stage
    can leave gigabytes); those of a live process or of another host are kept. Returns what was removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?P<host>.+)-(?P<pid>\d+)\.[^.]+\.tmp")
    removed = []
    for sibling in path.parent.iterdir():
        match = pattern.fullmatch(sibling.name)
        if match and match["host"] == socket.gethostname() and not _process_alive(int(match["pid"])):
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    sibling.unlink()
            removed.append(sibling)
    return removed


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode(path: Path, is_dir: bool) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; give outputs the usual umask-based mode."""
    os.chmod(path, (0o777 if is_dir else 0o666) & ~_umask())


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary sibling of ``path`` for writing; rename it to ``path`` on success only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        _default_mode(Path(tmp), is_dir=False)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        full = disk_full_error(exc, path)
        if full is not None:
            raise full from exc
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_file(path) as fh:
        fh.write(dumps_json(obj))


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as fh:
        fh.write(text)


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def replace_dir(complete: Path, path: Path) -> None:
    """Put the finished folder ``complete`` at ``path`` (replacing an older one there), synced to disk."""
    fsync_dir(complete)
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(complete, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(complete, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success it replaces ``path`` in one rename.

    On failure the temporary folder is removed and an existing ``path`` is left untouched; running out
    of space raises :class:`DiskFull` naming ``path``. A temporary that a killed writer left is removed
    when ``path`` is next written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _default_mode(tmp, is_dir=True)
        replace_dir(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full_error(exc, path)
        if full is not None:
            raise full from exc
        raise


def stable_hash(obj: Any, length: int = 12) -> str:
    """A hash of a JSON-able object that is the same in every process (unlike ``hash()``)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]
