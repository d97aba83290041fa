"""Step-3.5-Flash end to end on the current stack: a tiny folder in the published layout (legacy config keys,
``moe.*`` stacked experts, ``moe.router_bias``, MTP layers, its own tokenizer with a chat template;
tests/step3p5_folder.py) and a chat JSONL corpus go through ``snakemake paper`` with StepFun's recipe
(config/recipes/step3p5-flash-sft.yaml) at a tiny size: no dense run, the warmup gate judged against the base
model's routing, the coverage set, evaluation, lm-eval, the paper; the export loads with ``from_pretrained``
and is the published layout, MTP layers included. On the pinned stack the same overlays are refused at the
config check, naming the current stack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import copy_workflow, executed_rules, results, snakemake
from safetensors import safe_open
from step3p5_folder import LAYERS, MTP, file_tensors, write_published_folder

from moeflow.data.tokenizer import train_tokenizer
from moeflow.model.safetensors_files import weight_files
from moeflow.runtime import compat

pytestmark = pytest.mark.pipeline
RECIPE = "config/recipes/step3p5-flash-sft.yaml"
WORDS = "alpha beta gamma delta print return class import while lambda yield 42 ( ) :".split()


def chat_corpus(path: Path, conversations: int = 160) -> list[str]:
    """One JSON object per line with a ``messages`` list (user, assistant); the texts for the tokenizer."""
    rng = np.random.default_rng(0)
    texts, lines = [], []
    for i in range(conversations):
        question = " ".join(rng.choice(WORDS, int(rng.integers(4, 12)))) + f" #{i}?"
        answer = " ".join(rng.choice(WORDS, int(rng.integers(6, 20)))) + f" (answer {i})"
        texts += [question, answer]
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        )
    path.write_text("\n".join(lines) + "\n")
    return texts


def user_overlay() -> dict:
    """The recipe at a tiny size (steps, sequence length, batch) on this machine, with the folder and the corpus.
    For CI's time the coverage stage's micro-batch (``pretrain``) is fine-tuning's, so the experts are timed once
    (one choose_experts job instead of two), as in tests/user_models.py."""
    return {
        "model": {"pretrained": "models/step3p5", "attn_implementation": "eager"},
        "data": {
            "seq_len": 64,
            "split": {"heldout": 0.25, "test": 0.15},
            "sources": {
                "general": None,
                "target": None,
                "chat": {"type": "jsonl", "path": "chat.jsonl", "messages_field": "messages"},
            },
            "base_corpus": "chat",
            "finetune_corpus": "chat",
            "eval_corpora": ["chat"],
        },
        "coverage": {"pool_corpora": ["chat"], "min_docs_per_expert": 1, "token_budget": 2048, "batch_tokens": 1024},
        "pretrain": {"micro_batch_size": 2},
        "train": {
            "steps": 3,
            "warmup_steps": 2,
            "micro_batch_size": 2,
            "grad_accum_steps": 1,
            "eval_every": 0,
            "eval_max_sequences": 4,
            "routing_guard": {"window_steps": 2},
        },
        "evaluate": {
            "tasks": ["moeflow_perplexity"],
            "lm_eval": {"limit": 4, "bootstrap_iters": 10},
            "humaneval": {"enabled": False},
        },
        "export": {"max_shard_size": "100KB"},  # several files and an index, as the published folder has
    }


@pytest.fixture
def workdir(tmp_path) -> Path:
    workdir = copy_workflow(tmp_path / "moeflow")
    texts = chat_corpus(workdir / "chat.jsonl")
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    write_published_folder(workdir / "models" / "step3p5", len(tokenizer), tokenizer)
    (workdir / "config" / "user.yaml").write_text(yaml.safe_dump(user_overlay()))
    return workdir


def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, file in weight_files(folder).items():
        with safe_open(str(file), "pt") as f:
            out[name] = tuple(f.get_slice(name).get_shape())
    return out


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="Step-3.5-Flash is a current-stack model")
def test_the_published_layout_goes_through_snakemake_paper_and_exports_the_published_layout(workdir):
    # what ran, from the run's own log (a dry run before it would cost a Snakemake start of CI time)
    done = snakemake(workdir, "paper", "--cores", "2", "--configfile", RECIPE, "config/user.yaml")
    rules = executed_rules(done)
    assert {"coverage_valset", "warmup", "train_model", "evaluate_run", "lm_eval_task", "paper"} <= rules, rules
    assert not rules & {"pretrain_base", "humaneval_generate"} and "runs/dense" not in done.stderr, rules

    res, source = results(workdir), workdir / "models" / "step3p5"
    (warmup,) = (res / "warmup").iterdir()
    gate = json.loads((warmup / "routing_report.json").read_text())
    assert gate["stable"] and gate["thresholds"]["reference"] == "base" and gate["base_layers"]
    (coverage,) = (res / "coverage").iterdir()
    assert json.loads((coverage / "coverage.json").read_text())
    run = res / "runs" / "moe"
    assert (run / "eval" / "metrics.json").is_file()
    assert (run / "eval" / "lm_eval" / "finetuned" / "moeflow_perplexity.json").is_file()
    assert (res / "paper" / "provenance.json").is_file()
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert summary["mtp_layers"]["layers"] == MTP and summary["mtp_layers"]["trained"] is False

    model_dir = run / "model"
    assert shapes(model_dir) == shapes(source)  # the published names and shapes, MTP layers included
    assert any(f"layers.{LAYERS}.shared_head.output" in name for name in shapes(model_dir))
    assert (model_dir / "model.safetensors.index.json").is_file()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).read_bytes() == (source / name).read_bytes(), name
    from transformers import AutoModelForCausalLM

    from moeflow.families import registry

    registry.register()  # what moeflow adds to transformers: Step3p5ForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)
    assert type(model).__name__ == "Step3p5ForCausalLM" and not any(info.values()), info


@pytest.mark.skipif(compat.is_transformers_v5(), reason="the pinned stack's refusal")
def test_the_pinned_stack_refuses_the_same_overlays_at_config_check_naming_the_current_stack(workdir):
    done = snakemake(
        workdir, "paper", "--dry-run", "--cores", "2", "--configfile", RECIPE, "config/user.yaml", check=False
    )
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "models/step3p5/config.json names model_type 'step3p5'" in out and "the 'current' stack" in out, out[-2000:]


def train_losses(run: Path) -> list[tuple[float, float]]:
    """The run's (loss, MTP loss) of each training step, warmup's steps first (its metrics.jsonl)."""
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return [(r["loss"], r["mtp_loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="Step-3.5-Flash is a current-stack model")
def test_the_published_layout_trains_its_mtp_layers_in_bf16_on_two_fsdp_and_two_ep_ranks(workdir):
    """#36 items 0 and 1: the published-layout folder through ``snakemake train`` in bf16 with its MTP layers
    trained, as three runs of one config: one process (two micro-batches a step), two FSDP2 ranks and two
    expert-parallel ranks (one micro-batch each: the same global batch). Each rank reads its rows of the
    published files (the sharded loader: before the fix, warmup died at load, 'model.layers.2.mlp.gate.weight is
    in none of its weight files'; then the first backward failed on the MTP layers' bf16 gradients), warmup hands
    its checkpoint to train_model (a resume), and each export is the published layout with trained MTP layers.
    The sharded runs' losses are the one process's within bf16's rounding."""
    two = {"nproc_per_node": 2}
    overlay = {
        "precision": "bf16",
        "train": {"mtp": {"mode": "train"}, "micro_batch_size": 1, "grad_accum_steps": 2},
        "runs": {
            "moe": {},
            "fsdp": {"parallel": {"strategy": "fsdp", **two}, "hardware": {"num_devices": 2},
                     "train": {"grad_accum_steps": 1}},
            "ep": {"parallel": {"strategy": "ep", "ep_size": 2, **two}, "hardware": {"num_devices": 2},
                   "train": {"grad_accum_steps": 1}},
        },
    }  # fmt: skip
    (workdir / "config" / "layouts.yaml").write_text(yaml.safe_dump(overlay))
    done = snakemake(
        workdir, "train", "--cores", "2", "--configfile", RECIPE, "config/user.yaml", "config/layouts.yaml"
    )
    rules = executed_rules(done)
    assert {"warmup", "train_model"} <= rules, rules

    res, source = results(workdir), workdir / "models" / "step3p5"
    files = {name: tensor for name, tensor in file_tensors(source).items() if f"layers.{LAYERS}." in name}
    losses = {}
    for name in ("moe", "fsdp", "ep"):
        run = res / "runs" / name
        summary = json.loads((run / "train" / "summary.json").read_text())
        assert summary["mtp_layers"]["trained"] is True, name
        assert shapes(run / "model") == shapes(source), name  # the published names and shapes, MTP layers included
        exported = file_tensors(run / "model")
        assert any(not torch.equal(exported[n].float(), files[n].float()) for n in files), f"{name}: MTP unmoved"
        losses[name] = train_losses(run)
    assert len(losses["moe"]) == 3 and np.isfinite(losses["moe"]).all()
    for name in ("fsdp", "ep"):  # bf16: measured within 1e-4 of each other
        np.testing.assert_allclose(losses[name], losses["moe"], rtol=2e-3, err_msg=name)
