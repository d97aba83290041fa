"""A user's pretrained folder of every family through `snakemake train` (tests/user_models.py: a tiny
pretrained-style folder per family sharing one BPE tokenizer trained on the user's JSONL corpus, one run per
family in an overlay). No dense run appears (it belongs to the embedded default), the warmup gate, judging against
each folder's own base routing, passes, and each final model loads.

For CI's time (a Snakemake job costs about 10 s of interpreter, torch and transformers start) the work is split:
- here, one dry run schedules every trainable family's own training stages, and two families (END_TO_END) go
  through them in one ``snakemake train``, sharing one coverage validation set (``coverage.valset_of_run``): 13
  Snakemake jobs (the ``train`` target's included) instead of 38 (pinned) or 43 (current);
- tests/unit/test_user_model_stages.py runs every trainable family's folder through the same stage scripts in
  process (choose_experts, tokenize, plan_memory, warmup, train_model), with the same checks;
- the coverage stage of every family is tested in process in tests/unit/test_coverage.py, and step3p5's folder
  (trained on the current stack only) goes through ``snakemake paper`` in test_step3p5_pipeline.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import active_stack, copy_workflow, only_on, results, snakemake
from tiny_models import TRANSFORMERS_5_ONLY, model_config
from user_models import (
    REFUSED,
    TRAINED,
    check_final_model,
    check_warmup_report,
    overlay,
    save_family_folder,
    write_corpus,
)

from moeflow.data.tokenizer import train_tokenizer
from moeflow.runtime import compat

pytestmark = pytest.mark.pipeline

# The first owns the validation set. deepseek_v3: moeflow's own modeling code, a dense first layer, group-limited
# routing, an MTP layer; gpt_oss: eager attention only, expert and router biases, sliding and full layers.
END_TO_END = ("deepseek_v3", "gpt_oss")


def job_count(dry_run: str, rule: str) -> int:
    """The count of ``rule`` in a dry run's job-stats table."""
    table = dry_run.split("Job stats:", 1)[1]
    return next(int(line.split()[1]) for line in table.splitlines() if line.split()[:1] == [rule])


@only_on(
    "current",
    "the Snakefile's scheduling is the same on both; each family's stages: tests/unit/test_user_model_stages.py",
)
def test_every_trainable_familys_folder_is_scheduled_and_two_go_through_snakemake_train(tmp_path):
    workdir = copy_workflow(tmp_path / "moeflow")
    texts = write_corpus(workdir / "corpus.jsonl")
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    folders = {}
    for family in TRAINED:
        save_family_folder(family, workdir / "models" / family, tokenizer)
        folders[family] = f"models/{family}"
    (workdir / "config" / "user.yaml").write_text(yaml.safe_dump(overlay(folders)))

    dry = snakemake(workdir, "train", "--dry-run", "--cores", "2", "--configfile", "config/user.yaml").stdout
    # the embedded default's runs and stages only (a run's name shows in its paths and wildcards)
    assert not re.search(r"runs/dense\b|run=dense\b", dry) and "pretrain_base" not in dry
    for rule in ("warmup", "train_model", "plan_memory"):  # every family through its own training stages
        assert job_count(dry, rule) == len(TRAINED), rule

    (workdir / "config" / "two.yaml").write_text(yaml.safe_dump(overlay({f: folders[f] for f in END_TO_END})))
    snakemake(workdir, "train", "--cores", "2", "--configfile", "config/two.yaml")
    res = results(workdir)
    assert sorted(p.name for p in (res / "runs").iterdir()) == sorted(END_TO_END)
    assert len(list((res / "coverage").iterdir())) == 1  # the first run's, evaluated on by every run
    assert len(list((res / "warmup").iterdir())) == len(END_TO_END)
    for warmup in (res / "warmup").iterdir():
        check_warmup_report(json.loads((warmup / "routing_report.json").read_text()))
    for family in END_TO_END:
        check_final_model(res / "runs" / family / "model", family, len(tokenizer))


@pytest.mark.parametrize(
    "family", sorted(REFUSED) or [pytest.param(None, marks=pytest.mark.skip(reason="none refused"))]
)
def test_a_family_refused_on_this_stack_is_refused_at_config_check(tmp_path, family):
    """The folder's config.json names the family; the config check refuses it with docs/families.md's reason."""
    workdir = copy_workflow(tmp_path / "moeflow")
    write_corpus(workdir / "corpus.jsonl", docs=20)
    folder = workdir / "models" / family
    folder.mkdir(parents=True)
    config = {"model_type": family, "architectures": ["Step3p5ForCausalLM"], **model_config(family)["config"]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (workdir / "config" / "user.yaml").write_text(yaml.safe_dump(overlay({family: f"models/{family}"})))
    done = snakemake(workdir, "train", "--dry-run", "--cores", "2", "--configfile", "config/user.yaml", check=False)
    assert done.returncode != 0, f"{family} on {active_stack()} was not refused at config check"
    assert REFUSED[family] in done.stdout + done.stderr


assert compat.is_transformers_v5() or set(TRANSFORMERS_5_ONLY) <= set(REFUSED)  # transformers 5 only: refused on pinned
