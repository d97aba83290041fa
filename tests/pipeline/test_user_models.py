"""A user's pretrained folder of every family through `snakemake train`: a tiny pretrained-style folder per family
(random weights, ``save_pretrained``, a BPE tokenizer trained on the user's corpus saved next to it), the user's
JSONL corpus in an overlay, one run per family. No dense run appears (it belongs to the embedded default), the
warmup gate, judging against each folder's own base routing, passes, and each final model loads.

For CI's time the coverage validation set is built once, by the first family's run, and the other runs evaluate on
it (``coverage.valset_of_run``; the folders share one tokenizer): 38 Snakemake jobs instead of 44. The coverage
stage of every family is tested in process, in tests/unit/test_coverage.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import active_stack, copy_workflow, results, snakemake
from tiny_models import FAMILIES, TRANSFORMERS_5_ONLY, model_config

from moeflow.data.tokenizer import train_tokenizer
from moeflow.model.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed

pytestmark = pytest.mark.pipeline

# docs/families.md: step3p5 trains on the current stack only (transformers 4.57 has no such model; on transformers 5
# moeflow builds its causal LM). Every other family trains on both.
REFUSED = {} if compat.is_transformers_v5() else {"step3p5": "needs transformers 5, the 'current' stack"}
TRAINED = [f for f in FAMILIES if f not in REFUSED]
WORDS = "alpha beta gamma delta print return class import while lambda yield 42 ( ) :".split()


def write_corpus(path: Path, docs: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(6, 30)))) + f" # doc {i}\n" for i in range(docs)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def job_count(dry_run: str, rule: str) -> int:
    """The count of ``rule`` in a dry run's job-stats table."""
    table = dry_run.split("Job stats:", 1)[1]
    return next(int(line.split()[1]) for line in table.splitlines() if line.split()[:1] == [rule])


def save_family_folder(family: str, folder: Path, tokenizer) -> None:
    model = make_model(typed(ModelSettings, model_config(family)), vocab_size=len(tokenizer), seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def overlay(folders: dict[str, str]) -> dict:
    """The user's overlay. For the test's time only: one thread per job (``--cores 2`` runs two jobs at once), and
    the coverage stage's micro-batch (``pretrain``) equal to fine-tuning's, so each family's experts are timed once
    (one choose_experts job per family instead of two), and one coverage validation set for every run (the first
    run's: the folders share the tokenizer, so its token ids mean the same to every model)."""
    first_run, first = next(iter(folders.items()))
    return {
        "threads": 1,
        "model": {"pretrained": first, "attn_implementation": "eager"},  # gpt_oss has no sdpa
        "data": {
            "seq_len": 64,
            "split": {"heldout": 0.25, "test": 0.1},
            "sources": {"general": None, "target": None, "user": {"type": "jsonl", "path": "corpus.jsonl"}},
            "base_corpus": "user",
            "finetune_corpus": "user",
            "eval_corpora": ["user"],
        },
        "coverage": {"pool_corpora": ["user"], "min_docs_per_expert": 1, "token_budget": 2048, "batch_tokens": 1024},
        "pretrain": {"micro_batch_size": 2},
        "train": {
            "steps": 3,
            "warmup_steps": 2,
            "micro_batch_size": 2,
            "grad_accum_steps": 1,
            "eval_every": 0,
            "eval_max_sequences": 4,
            "checkpoint_every": 0,
            "routing_guard": {"window_steps": 2},
        },
        "runs": {
            "moe": None,
            **{
                family: {"model": {"pretrained": path}}
                | ({} if family == first_run else {"coverage": {"valset_of_run": first_run}})
                for family, path in folders.items()
            },
        },
        "paper": {"moe_run": first_run},
    }


def test_a_pretrained_folder_of_every_trainable_family_goes_through_snakemake_train(tmp_path):
    from transformers import AutoModelForCausalLM

    workdir = copy_workflow(tmp_path / "moeflow")
    texts = write_corpus(workdir / "corpus.jsonl")
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    folders = {}
    for family in TRAINED:
        save_family_folder(family, workdir / "models" / family, tokenizer)
        folders[family] = f"models/{family}"
    (workdir / "config" / "user.yaml").write_text(yaml.safe_dump(overlay(folders)))

    dry = snakemake(workdir, "train", "--dry-run", "--cores", "2", "--configfile", "config/user.yaml").stdout
    assert "dense" not in dry and "pretrain_base" not in dry  # the embedded default's runs and stages only
    for rule in ("warmup", "train_model", "plan_memory"):  # every family through its own training stages
        assert job_count(dry, rule) == len(TRAINED), rule
    snakemake(workdir, "train", "--cores", "2", "--configfile", "config/user.yaml")

    res = results(workdir)
    assert sorted(p.name for p in (res / "runs").iterdir()) == sorted(TRAINED)
    assert len(list((res / "coverage").iterdir())) == 1  # the first run's, evaluated on by every run
    for warmup in (res / "warmup").iterdir():
        report = json.loads((warmup / "routing_report.json").read_text())
        assert report["stable"] and report["thresholds"]["reference"] == "base" and report["base_layers"], warmup
    for family in TRAINED:
        model = AutoModelForCausalLM.from_pretrained(res / "runs" / family / "model", local_files_only=True)
        assert model.config.model_type == family and model.config.vocab_size == len(tokenizer)


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
