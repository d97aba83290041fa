#!/usr/bin/env python3
"""Print the pip requirements of a conda environment file, one per line.

The conda files in envs/ are the one source of truth for both stacks: `make env` and `.ci/run` install
what this prints. ``--cuda`` prints the optional CUDA-only pins instead (flash-attn: compiled against the
CUDA toolkit, installed on a CUDA node after the stack with ``pip install --no-build-isolation``).
Standard library only, so it runs before any environment exists.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moeflow.runtime.pins import cuda_requirements, pip_requirements  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    cuda = args[:1] == ["--cuda"]
    if len(args) != 1 + cuda:
        sys.exit("usage: pip_pins.py [--cuda] ENV_FILE")
    print("\n".join((cuda_requirements if cuda else pip_requirements)(args[-1])))
