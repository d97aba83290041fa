#!/usr/bin/env python3
"""Print the pip requirements of a conda environment file, one per line.

The conda files in envs/ are the one source of truth for both stacks: `make env` and `.ci/run` install
what this prints. Standard library only, so it runs before any environment exists.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moeflow.pins import pip_requirements  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: pip_pins.py ENV_FILE")
    print("\n".join(pip_requirements(sys.argv[1])))
