"""The pip requirements of a stack's conda environment file (envs/<stack>.yaml): the one source of truth.

Standard library only: ``tools/pip_pins.py`` uses it before any environment exists, and
``moeflow.env`` uses it to compare what is installed with the pins.
"""

from __future__ import annotations

from pathlib import Path


def pip_requirements(env_file: str | Path) -> list[str]:
    lines = Path(env_file).read_text(encoding="utf-8").splitlines()
    reqs: list[str] = []
    pip_indent = None
    for line in lines:
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip():
            continue
        indent = len(stripped) - len(stripped.lstrip())
        item = stripped.strip()
        if pip_indent is None:
            if item == "- pip:":
                pip_indent = indent
            continue
        if indent <= pip_indent:
            break
        if not item.startswith("- "):
            raise ValueError(f"{env_file}: unexpected line in the pip section: {line!r}")
        reqs.append(item[2:].strip())
    if pip_indent is None:
        raise ValueError(f"{env_file}: no '- pip:' section")
    return reqs


def pinned_versions(env_file: str | Path) -> dict[str, str]:
    """``{distribution name (lower case, '-' for '_'): version}`` for every ``name==version`` pin."""
    pins: dict[str, str] = {}
    for req in pip_requirements(env_file):
        name, sep, version = req.partition("==")
        if not sep:
            raise ValueError(f"{env_file}: {req!r} is not pinned with '=='")
        pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins
