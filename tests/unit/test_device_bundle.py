"""The device bundle's rules (benchmarks/device_bundle.py), without downloading: what ships is the current stack's
pins and never torch, a requirement the bundle and the machine both miss is named with the line to add, a version
read on the machine that a bundled package rejects is caught, and the install check finds a bundled package that
does not import from the bundle's folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moeflow.runtime.pins import pip_requirements

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import device_bundle as B  # noqa: E402


def test_the_bundle_carries_the_current_stacks_pins_and_never_torch():
    pins = B.bundle_pins()
    stack = dict(line.split("==") for line in pip_requirements(REPO / "envs" / "current.yaml"))
    for name in B.FROM_CURRENT_STACK:
        assert pins[name] == stack[name], name
    assert "torch" not in pins and not any(n.startswith("nvidia-") for n in pins)
    assert not set(pins) & (B.DEVICE_IMAGE - {"transformers", "packaging"})  # nothing the machine has, but these two


def test_the_mimic_installs_only_what_the_machine_has():
    """envs/device.txt (the CPU mimic's packages) names nothing the machine's image lacks."""
    names = [B.canonical(line.split("#")[0].split("==")[0].strip()) for line in (REPO / "envs" / "device.txt").open()]
    assert {n for n in names if n} <= B.DEVICE_IMAGE


def fake(name: str, version: str, *requires: str) -> dict:
    return {"name": name, "version": version, "requires": list(requires)}


def test_an_unmet_requirement_is_named_with_the_line_to_add():
    found = {
        "snakemake": fake(
            "snakemake", "9.27.1", "pulp<3.4,>=2.3.1", "jinja2<4", "tabulate", "colorama; sys_platform == 'win32'"
        ),
        "pulp": fake("pulp", "3.3.2"),
        "lm-eval": fake("lm-eval", "0.4.13", "word2number", "datasets>=2.16; extra == 'x'", "numpy>=3"),
    }
    problems = B.unmet_requirements(found, B.on_the_machine)
    assert any("word2number" in p and "LOCK in benchmarks/device_bundle.py" in p for p in problems), problems
    assert any("numpy>=3" in p and "the machine has numpy 2.5.2" in p for p in problems), problems
    assert len(problems) == 2  # the Windows-only and the extra's requirements do not count; jinja2, tabulate are there
    found["pulp"] = fake("pulp", "3.5.0")
    assert any("the bundle has pulp 3.5.0" in p for p in B.unmet_requirements(found, B.on_the_machine))


def installed_tool(tmp_path, monkeypatch, requires: str = "") -> tuple[Path, Path, Path]:
    """A bundle pinning some-tool 1.0 and a site folder on sys.path holding it (its METADATA ``requires`` lines):
    (bundle, site, the METADATA file)."""
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    bundle.mkdir()
    site.mkdir()
    (bundle / B.REQUIREMENTS).write_text("some-tool==1.0\n")
    dist = site / "some_tool-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: some-tool\nVersion: 1.0\n{requires}")
    monkeypatch.syspath_prepend(str(site))
    return bundle, site, dist / "METADATA"


def test_the_install_check_refuses_a_package_that_does_not_import_from_the_bundle(tmp_path, monkeypatch):
    bundle, site, _ = installed_tool(tmp_path, monkeypatch)
    report = B.check(bundle, site, mimic=False)
    assert report["bundled"] == 1 and report["torch"]  # torch: this environment's own
    (bundle / B.REQUIREMENTS).write_text("some-tool==1.1\n")
    with pytest.raises(SystemExit, match="some-tool: 1.0 from .* imports, not the bundle's 1.1"):
        B.check(bundle, site, mimic=False)


def test_the_install_check_fails_on_a_machine_package_a_bundled_one_rejects(tmp_path, monkeypatch):
    """A version conflict the install cannot resolve (the machine's package at a version a bundled package
    rejects, with no meeting version in the bundle to shadow it) fails the check, naming the line to add; it
    was only a warning, and the GPU run then failed at import on the lent machine's minutes."""
    bundle, site, metadata = installed_tool(tmp_path, monkeypatch, "Requires-Dist: pytest<999\n")
    assert B.check(bundle, site, mimic=False)["bundled"] == 1
    metadata.write_text(metadata.read_text().replace("pytest<999", "pytest<1"))
    with pytest.raises(SystemExit, match=r"some-tool needs pytest<1: pytest .* is installed: add a meeting version"):
        B.check(bundle, site, mimic=False)
