"""The pip requirements of a stack's conda environment file (envs/<stack>.yaml): the one source of truth.

Two lists: the ``- pip:`` list of the conda dependencies, which every install of the stack gets (conda,
``make env``, CI), and the optional ``cuda_pip:`` section of pins for CUDA nodes only (flash-attn, which
compiles against the CUDA toolkit), installed by hand with ``tools/pip_pins.py --cuda``; conda skips the
section. Standard library only: ``tools/pip_pins.py`` uses it before any environment exists, and
``moeflow.runtime.env`` uses it to compare what is installed with the pins.
"""

from __future__ import annotations

from pathlib import Path

PIP_SECTION = "- pip:"


CUDA_SECTION = "cuda_pip:"


def _section(env_file: str | Path, header: str) -> list[str] | None:
    """The ``- item`` lines indented under the line ``header`` (None when there is no such line)."""
    items: list[str] | None = None
    header_indent = 0
    for line in Path(env_file).read_text(encoding="utf-8").splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip():
            continue
        indent = len(stripped) - len(stripped.lstrip())
        item = stripped.strip()
        if items is None:
            if item == header:
                items, header_indent = [], indent
            continue
        if indent <= header_indent:
            break
        if not item.startswith("- "):
            raise ValueError(f"{env_file}: unexpected line in the {header!r} section: {line!r}")
        items.append(item[2:].strip())
    return items


def pip_requirements(env_file: str | Path) -> list[str]:
    """The conda file's pip list: what every install of the stack gets."""
    reqs = _section(env_file, PIP_SECTION)
    if reqs is None:
        raise ValueError(f"{env_file}: no '- pip:' section")
    return reqs


def cuda_requirements(env_file: str | Path) -> list[str]:
    """The optional pins for CUDA nodes (the ``cuda_pip:`` section; empty without one)."""
    return _section(env_file, CUDA_SECTION) or []


def _versions(env_file: str | Path, reqs: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for req in reqs:
        name, sep, version = req.partition("==")
        if not sep:
            raise ValueError(f"{env_file}: {req!r} is not pinned with '=='")
        pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def pinned_versions(env_file: str | Path) -> dict[str, str]:
    """``{distribution name (lower case, '-' for '_'): version}`` for every ``name==version`` pin of the pip list."""
    return _versions(env_file, pip_requirements(env_file))


def cuda_pinned_versions(env_file: str | Path) -> dict[str, str]:
    """The same for the optional CUDA-only pins."""
    return _versions(env_file, cuda_requirements(env_file))
