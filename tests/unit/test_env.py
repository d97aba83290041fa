"""Environment verification: facts only, identical bytes on a rerun, the pins compared, strictness."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import active_stack

from moeflow.runtime import compat, env
from moeflow.runtime.files import dumps_json
from moeflow.runtime.pins import pinned_versions
from moeflow.settings import REPO_ROOT

ENV_FILE = REPO_ROOT / "envs" / f"{active_stack()}.yaml"


@pytest.fixture(scope="module")
def report():
    return env.collect(active_stack(), ENV_FILE, trust_remote_code={"moe": False, "remote": True})


def changed_env_file(tmp_path: Path) -> Path:
    """A copy of the active env file with the transformers pin changed and a package that is not installed."""
    text = ENV_FILE.read_text()
    installed = pinned_versions(ENV_FILE)["transformers"]
    text, n = re.subn(r"transformers==[^\s#]+", "transformers==3.0.0", text)
    assert n == 1 and installed != "3.0.0"
    text = text.replace("      - torch==", "      - moeflow-no-such-package==1.0\n      - torch==", 1)
    path = tmp_path / "changed.yaml"
    path.write_text(text)
    return path


def test_two_report_builds_give_identical_bytes(report):
    again = env.collect(active_stack(), ENV_FILE, trust_remote_code={"remote": True, "moe": False})
    assert dumps_json(again) == dumps_json(report)
    assert env.render_markdown(again) == env.render_markdown(report)


def test_report_holds_the_facts_and_no_clock_or_free_memory(report):
    system, facts = report["system"], report["torch"]
    assert system["python"] and system["cpu_count"] >= 1 and system["ram_total_bytes"] > 2**30
    assert facts["version"] == torch.__version__
    assert report["packages"]["transformers"] == str(compat.version_of("transformers"))
    assert set(env.REPORTED_PACKAGES) <= set(report["packages"])
    volatile = [key for key in all_keys(report) if re.search(r"(?<!run)time|date|free|used|pid|load", key)]
    assert volatile == []


def all_keys(tree) -> list[str]:
    if isinstance(tree, dict):
        return [k for k, v in tree.items() for k in [k, *all_keys(v)]]
    if isinstance(tree, list):
        return [k for item in tree for k in all_keys(item)]
    return []


def test_report_says_whether_there_is_a_gpu(report):
    gpus = report["torch"]["gpus"]
    if torch.cuda.is_available():
        assert len(gpus) == torch.cuda.device_count()
        assert all(g["memory_bytes"] > 0 and re.fullmatch(r"\d+\.\d+", g["compute_capability"]) for g in gpus)
    else:  # this machine
        assert gpus == []
        assert report["torch"]["gpu_summary"].startswith("no GPU")
        assert "no GPU" in env.render_markdown(report)
        assert report["attention_implementations"]["flash_attention_2"]["available"] is False


def test_attention_and_experts_implementations_per_stack(report):
    attention = report["attention_implementations"]
    assert attention["eager"]["available"] and attention["sdpa"]["available"]
    experts = report["experts_implementations"]
    if compat.is_transformers_v5():
        impls = experts["implementations"]
        assert experts["supported"]
        assert all(impls[name]["available"] for name in ("eager", "grouped_mm", "batched_mm"))
        if not torch.cuda.is_available():
            gpu_only = {name for name in impls if name in env.GPU_EXPERTS_CHECKS}
            assert gpu_only and all(impls[name]["available"] is False for name in gpu_only)
    else:
        assert not experts["supported"] and "transformers 5" in experts["reason"]


def test_installed_packages_match_the_active_pins(report):
    assert report["pins"]["differences"] == [], report["pins"]["differences"]
    assert report["pins"]["matches"] and report["pins"]["pinned_packages"] == len(pinned_versions(ENV_FILE))


def test_strict_verification_fails_listing_every_difference(tmp_path):
    changed = changed_env_file(tmp_path)
    report = env.collect(active_stack(), changed)
    with pytest.raises(env.EnvironmentMismatch) as err:
        env.enforce(report, strict=True)
    message = str(err.value)
    installed = str(compat.version_of("transformers"))
    assert f"transformers: pinned ==3.0.0, installed {installed}" in message
    assert "moeflow-no-such-package: pinned ==1.0, not installed" in message
    assert "2 difference(s)" in message and "env.strict" in message


def test_lenient_verification_warns_and_records(tmp_path, caplog):
    report = env.collect(active_stack(), changed_env_file(tmp_path), trust_remote_code={"r": True})
    with caplog.at_level(logging.WARNING, logger="moeflow.runtime.env"):
        warnings = env.enforce(report, strict=False)
    assert report["pins"]["differences"] == [
        {"package": "moeflow-no-such-package", "pinned": "1.0", "installed": None},
        {"package": "transformers", "pinned": "3.0.0", "installed": str(compat.version_of("transformers"))},
    ]
    assert not report["pins"]["matches"]
    assert len(warnings) == 3 and any("trust_remote_code" in w for w in warnings)
    assert "transformers: pinned ==3.0.0" in caplog.text
    markdown = env.render_markdown(report)
    assert "2 difference(s)" in markdown and "- `r`: yes" in markdown


def test_trust_remote_code_is_reported_per_run(report):
    assert report["trust_remote_code"] == {"moe": False, "remote": True}


@pytest.mark.parametrize(
    "installed, pinned, same",
    [("2.13.0+cpu", "2.13.0", True), ("2.3.1", "2.3.1", True), ("2.3.1", "2.3.0", False), ("1.0rc1", "1.0rc1", True)],
)
def test_versions_compare_as_pip_reads_a_pin(installed, pinned, same):
    assert env.version_matches(installed, pinned) is same


def test_device_memory_comes_from_the_report(report):
    ram, source = env.device_memory_bytes(report, "cpu")
    assert ram == report["system"]["ram_usable_bytes"] and "RAM" in source
    gpu, source = env.device_memory_bytes(report, "cuda")
    if not report["torch"]["gpus"]:
        assert gpu is None and "no GPU" in source


def test_an_optional_cuda_pin_that_is_not_installed_is_no_difference(report):
    """flash-attn on a CPU machine: reported as an optional CUDA pin, not as missing."""
    from moeflow.runtime.pins import cuda_pinned_versions

    optional = {pin["package"]: pin for pin in report["pins"]["optional_cuda"]}
    assert set(optional) == set(cuda_pinned_versions(ENV_FILE)) == {"flash-attn"}
    if optional["flash-attn"]["installed"] is None:
        assert all(d["package"] != "flash-attn" for d in report["pins"]["differences"])
        assert "optional CUDA pin flash-attn" in env.render_markdown(report)


def test_an_optional_cuda_pin_installed_at_another_version_is_a_difference(monkeypatch):
    real = env.installed_version
    monkeypatch.setattr(env, "installed_version", lambda name: "0.0.1" if name == "flash-attn" else real(name))
    [pin] = env.optional_cuda_pins(ENV_FILE)
    assert (pin["installed"], pin["matches"]) == ("0.0.1", False)
    report = env.collect(active_stack(), ENV_FILE)
    assert [d["package"] for d in report["pins"]["differences"]] == ["flash-attn"] and not report["pins"]["matches"]
