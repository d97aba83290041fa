"""Config errors come from ``snakemake -n`` before any job runs, naming the key: the workflow merges the
overlays by moeflow's rules (null removes, a source of another type is replaced whole, model_from_config)."""

from __future__ import annotations

import pytest
import yaml
from conftest import copy_workflow, snakemake

pytestmark = [pytest.mark.pipeline, pytest.mark.fast]  # dry runs only

BAD_OVERLAYS = {
    "hub id": (
        {"model": {"pretrained": "Qwen/Qwen3-30B-A3B"}},
        "`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir models/qwen3-30b-a3b`",
    ),
    "key of another kind of source": (
        {"data": {"sources": {"notes": {"type": "text", "path": "notes", "packages": ["json"]}}}},
        "config key 'data.sources.notes': packages do not apply to a source of type text",
    ),
    "run dropped but named by the paper": ({"runs": {"dense": None}}, "'paper.dense_runs': 'dense' is not a run"),
    "run changes a pretrained model": (
        {"model": {"pretrained": "."}, "runs": {"wide": {"model": {"config": {"hidden_size": 64}}}}},
        "config key 'runs.wide.model.config': run 'wide' changes model.config",
    ),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("config_check") / "moeflow")


@pytest.mark.parametrize("case", sorted(BAD_OVERLAYS))
def test_a_bad_overlay_fails_the_dry_run_naming_the_key(workdir, case):
    overlay, expected = BAD_OVERLAYS[case]
    path = workdir / f"{case.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(overlay))
    done = snakemake(workdir, "paper", "-n", "--configfile", "config/smoke.yaml", str(path), check=False)
    assert done.returncode != 0 and expected in done.stdout + done.stderr
    assert not (workdir / "results").exists()


def test_overlays_merge_by_moeflows_rules_in_the_dry_run(workdir):
    """A source of another type replaces the default's (its packages do not survive), and dropping the dense
    run with the paper's comparison leaves one run: the dry run plans without error."""
    (workdir / "t.jsonl").write_text('{"text": "def f(x):\\n    return x\\n"}\n')
    path = workdir / "swap.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": {"sources": {"target": {"type": "jsonl", "path": "t.jsonl"}}},
                "runs": {"dense": None},
                "paper": {"dense_runs": []},
            }
        )
    )
    done = snakemake(workdir, "paper", "-n", "--configfile", "config/smoke.yaml", str(path))
    assert "runs/dense" not in done.stdout and "runs/moe/model" in done.stdout
