#!/usr/bin/env python3
"""Print the pip requirements of a conda environment file, one per line.

The conda files in envs/ are the one source of truth for both stacks: `make` and `.ci/run` install
`pip install -r <(python3 tools/pip_pins.py envs/pinned.yaml)`. Standard library only, so it runs
before any environment exists. Understands the layout of our env files (a `- pip:` list).
"""

from __future__ import annotations

import sys
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: pip_pins.py ENV_FILE")
    print("\n".join(pip_requirements(sys.argv[1])))
