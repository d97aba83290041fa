"""The two stacks: the conda env files are the one source of truth for what gets installed."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
import yaml

from moeflow import config as mfconfig
from moeflow.pins import pinned_versions, pip_requirements

ENVS = mfconfig.REPO_ROOT / "envs"


@pytest.mark.parametrize("stack", mfconfig.STACKS)
def test_env_file_is_a_conda_env_with_every_pip_package_pinned(stack):
    env = yaml.safe_load((ENVS / f"{stack}.yaml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    # the reader used by the Makefile and CI gives exactly the YAML's pip list
    assert pip_requirements(ENVS / f"{stack}.yaml") == pip_section
    assert all("==" in req for req in pip_section), "every package is pinned with =="


def test_the_stacks_pin_what_the_issues_require():
    pinned, current = pinned_versions(ENVS / "pinned.yaml"), pinned_versions(ENVS / "current.yaml")
    assert pinned["torch"] == "2.3.1" and pinned["transformers"] == "4.57.1"
    assert pinned["datasets"].startswith("4.") and pinned["tokenizers"].startswith("0.22")
    assert int(current["transformers"].split(".")[0]) == 5 and current["datasets"].startswith("5.")
    assert tuple(map(int, current["torch"].split(".")[:2])) >= (2, 13)
    assert set(pinned) - {"nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "nvidia-nccl-cu12"} == set(current)


def test_what_ci_installed_is_exactly_the_active_stacks_pins():
    """Make and .ci/run install from the env file: the running environment must match it."""
    transformers_major = int(metadata.version("transformers").split(".")[0])
    stack = "current" if transformers_major >= 5 else "pinned"
    differences = {
        name: (want, metadata.version(name))
        for name, want in pinned_versions(ENVS / f"{stack}.yaml").items()
        if metadata.version(name).split("+")[0] != want
    }
    assert differences == {}


def test_pip_pins_tool_prints_the_requirements():
    out = subprocess.run(
        [sys.executable, str(mfconfig.REPO_ROOT / "tools" / "pip_pins.py"), str(ENVS / "pinned.yaml")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == pip_requirements(ENVS / "pinned.yaml")
