"""Every trainable family's pretrained folder through the stage scripts, in this process: the per-family half of
tests/pipeline/test_user_models.py, moved here for CI's time (a Snakemake job costs about 10 s of interpreter,
torch and transformers start; here the stages share one). That pipeline test runs two of these families through
``snakemake train`` and dry-runs every family's jobs; this one runs every family's stages.

The same folders and overlay (tests/user_models.py), each run's config from moeflow's own loader, each job from
the settings functions the rules pass (moeflow.workflow.keys). The scripts of choose_experts, plan_memory,
coverage_valset, warmup and train_model run as Snakemake or torchrun would start them (``runpy``, with the rule's
``snakemake`` object or ``--job`` argument); tokenize is moeflow.data.sharding's call, as its script makes it.
The warmup gate passes against each folder's own base routing, and each final model loads with transformers'
``from_pretrained``."""

from __future__ import annotations

import contextlib
import json
import logging
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import active_stack
from user_models import TRAINED, check_final_model, check_warmup_report, overlay, save_family_folder, write_corpus

from moeflow.data.sharding import TokenizeStage, tokenize_corpus
from moeflow.data.tokenizer import train_tokenizer
from moeflow.runtime import env
from moeflow.runtime.files import read_json, write_json
from moeflow.runtime.job import Named
from moeflow.settings import REPO_ROOT, typed
from moeflow.workflow import keys
from moeflow.workflow.load import load, run_config
from moeflow.workflow.rule_settings import rule_settings

SCRIPTS = REPO_ROOT / "workflow" / "scripts"
FIRST = TRAINED[0]  # its coverage validation set serves every run (coverage.valset_of_run), as in the pipeline test


@contextlib.contextmanager
def own_logging():
    """The root logger as it was: a stage's setup_logging replaces its handlers (pytest's among them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def run_torchrun_script(script: str, rule: str, input: dict, output: dict, params: dict) -> None:
    """A training rule's script as its torchrun launcher starts it (one rank): ``--job`` JSON, as common.smk's
    torchrun_params pass it (settings and runtime inside the job here: Job.from_argv merges them)."""
    job = json.dumps({"rule": rule, "input": input, "output": output, "params": params}, sort_keys=True)
    argv = sys.argv
    sys.argv = [script, "--job", job, "--threads", "1"]
    try:
        with own_logging():
            runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    finally:
        sys.argv = argv


def run_snakemake_script(script: str, rule: str, input: dict, output: dict, params: dict) -> None:
    """A ``script:`` rule's script with the ``snakemake`` object Snakemake gives it (named items only)."""
    smk = SimpleNamespace(
        rule=rule,
        input=Named(input),
        output=Named(output),
        params=Named(params),
        threads=1,
        log=[],
        resources=SimpleNamespace(gpu=0),
    )
    with own_logging():
        runpy.run_path(str(SCRIPTS / script), init_globals={"snakemake": smk}, run_name="__main__")


class UserRuns:
    """The folders, the overlay's runs and each family's stage outputs under ``root`` (the working directory)."""

    def __init__(self, root: Path):
        self.root = root
        texts = write_corpus(root / "corpus.jsonl")
        tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
        self.vocab_size = len(tokenizer)
        folders = {}
        for family in TRAINED:
            save_family_folder(family, root / "models" / family, tokenizer)
            folders[family] = f"models/{family}"
        (root / "user.yaml").write_text(json.dumps(overlay(folders)))
        config = load(root / "user.yaml")
        self.runs = {family: run_config(config, family) for family in TRAINED}
        self.env = root / "env.json"
        write_json(self.env, env.collect(active_stack(), REPO_ROOT / "envs" / f"{active_stack()}.yaml"))
        self.valset = self.coverage_valset(FIRST)

    def runtime(self, family: str) -> dict:
        cfg = self.runs[family]
        return {"stack": active_stack(), "precision": cfg["precision"], "seed": cfg["seed"]}

    def experts(self, family: str) -> str:
        """Rule choose_experts (one micro-batch for both parts: the overlay makes pretrain's equal to train's)."""
        cfg = self.runs[family]
        assert keys.experts_key(cfg, "train") == keys.experts_key(cfg, "pretrain")
        out = f"experts/{keys.experts_key(cfg)}"
        if not Path(out, "choice.json").exists():
            outputs = {"choice": f"{out}/choice.json", "timings": f"{out}/timings.json"}
            params = {"settings": keys.experts_settings(cfg), "runtime": self.runtime(family)}
            run_snakemake_script("choose_experts.py", "choose_experts", {}, outputs, params)
        return f"{out}/choice.json"

    def data(self, family: str) -> str:
        """Rule tokenize: the fine-tuning corpus through the family folder's own tokenizer."""
        cfg = self.runs[family]
        out = f"data/{keys.data_key(cfg)}/{cfg['data']['finetune_corpus']}"
        if not Path(out).exists():
            settings = typed(TokenizeStage, keys.data_settings(cfg))
            tokenize_corpus(cfg["data"]["finetune_corpus"], settings, cfg["model"]["pretrained"], out, threads=1)
        return out

    def coverage_valset(self, family: str) -> str:
        cfg = self.runs[family]
        out = f"coverage/{keys.coverage_key(cfg)}"
        inputs = {"model": cfg["model"]["pretrained"], "experts": self.experts(family), "pool": [self.data(family)]}
        outputs = {"valset": f"{out}/valset", "json": f"{out}/coverage.json", "heatmap": f"{out}/heatmap.png"}
        params = {"settings": rule_settings("coverage_valset", cfg, {}, cfg), "runtime": self.runtime(family)}
        run_torchrun_script("coverage_valset.py", "coverage_valset", inputs, outputs, params)
        return outputs["valset"]

    def plan_memory(self, family: str) -> str:
        outputs = {"json": f"runs/{family}/plan.json", "md": f"runs/{family}/plan.md"}
        params = {"settings": keys.plan_settings(self.runs[family]), "runtime": self.runtime(family)}
        run_snakemake_script("plan_memory.py", "plan_memory", {"env": str(self.env)}, outputs, params)
        return outputs["json"]

    def warmup(self, family: str) -> Path:
        cfg = self.runs[family]
        key = keys.warmup_key(cfg)
        inputs = {"model": cfg["model"]["pretrained"], "data": self.data(family), "experts": self.experts(family)}
        params = {
            "settings": keys.warmup_settings(cfg),
            "runtime": self.runtime(family),
            "checkpoints": "checkpoints",
            "failed_report": f"logs/warmup/{key}.routing_report.json",
        }
        run_torchrun_script("warmup.py", "warmup", inputs | {"selection": []}, {"checkpoint": f"warmup/{key}"}, params)
        return Path(f"warmup/{key}")

    def train_model(self, family: str, warmup: Path, plan: str) -> Path:
        cfg = self.runs[family]
        inputs = {
            "model": cfg["model"]["pretrained"],
            "warmup": str(warmup),
            "data": self.data(family),
            "experts": self.experts(family),
            "valset": self.valset,
            "plan": plan,
            "selection": [],
        }
        out = f"runs/{family}"
        outputs = {"model": f"{out}/model", "logs": f"{out}/train", "adapter": f"{out}/adapter"}
        params = {
            "settings": keys.train_model_settings(cfg),
            "runtime": self.runtime(family),
            "checkpoints": "checkpoints",
        }
        run_torchrun_script("train_model.py", "train_model", inputs, outputs, params)
        return Path(outputs["model"])


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_models")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        yield UserRuns(root)


@pytest.mark.parametrize("family", TRAINED)
def test_a_pretrained_folder_of_the_family_goes_through_the_training_stages(user_runs, family, monkeypatch):
    monkeypatch.chdir(user_runs.root)
    cfg = user_runs.runs[family]
    assert cfg["model"]["pretrained"] == f"models/{family}"
    plan = user_runs.plan_memory(family)  # the stage fails on a phase that does not fit
    warmup = user_runs.warmup(family)
    check_warmup_report(read_json(warmup / "routing_report.json"))
    model = user_runs.train_model(family, warmup, plan)
    summary = read_json(Path(f"runs/{family}/train/summary.json"))
    assert summary["steps"] == cfg["train"]["steps"] and summary["eval"], summary
    check_final_model(model, family, user_runs.vocab_size)
