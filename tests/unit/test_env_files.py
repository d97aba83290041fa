"""The two stacks: the conda env files are the one source of truth for what gets installed."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
import yaml

from moeflow.runtime.pins import cuda_pinned_versions, cuda_requirements, pinned_versions, pip_requirements
from moeflow.settings import REPO_ROOT
from moeflow.workflow.load import STACKS

ENVS = REPO_ROOT / "envs"


@pytest.mark.parametrize("stack", STACKS)
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
    # bitsandbytes (model.quantization) needs torch 2.4: the pinned stack refuses a quantized base at config check
    assert set(pinned) - {"nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "nvidia-nccl-cu12"} == set(current) - {
        "bitsandbytes"
    }


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
        [sys.executable, str(REPO_ROOT / "tools" / "pip_pins.py"), str(ENVS / "pinned.yaml")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == pip_requirements(ENVS / "pinned.yaml")


@pytest.mark.parametrize("stack", STACKS)
def test_flash_attn_is_an_optional_cuda_pin_that_the_cpu_install_skips(stack):
    """flash-attn compiles against the CUDA toolkit: pinned in the cuda_pip section, never in the pip list."""
    env_file = ENVS / f"{stack}.yaml"
    assert "flash-attn" not in pinned_versions(env_file)
    assert list(cuda_pinned_versions(env_file)) == ["flash-attn"]
    assert not any(req.startswith("flash-attn") for req in pip_requirements(env_file))
    assert "cuda_pip" not in yaml.safe_load(env_file.read_text())["dependencies"][-1]  # conda's pip never sees it
    assert "--no-build-isolation" in env_file.read_text()  # the note on building it


def test_the_flash_attn_pins_match_each_stacks_torch():
    # 2.6.3: releases built for torch 2.3 / CUDA 12; the current stack takes the newest release
    assert cuda_pinned_versions(ENVS / "pinned.yaml") == {"flash-attn": "2.6.3"}
    assert cuda_pinned_versions(ENVS / "current.yaml")["flash-attn"].startswith("2.8.")


def test_pip_pins_tool_prints_the_cuda_pins_only_when_asked():
    tool = [sys.executable, str(REPO_ROOT / "tools" / "pip_pins.py")]
    out = subprocess.run(
        tool + ["--cuda", str(ENVS / "pinned.yaml")], check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == cuda_requirements(ENVS / "pinned.yaml") == ["flash-attn==2.6.3"]
