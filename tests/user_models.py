"""A user's pretrained folders, one per trainable family, and the overlay that trains each: shared by
tests/pipeline/test_user_models.py (through ``snakemake train``) and tests/unit/test_user_model_stages.py (the
same folders and overlay through the stage scripts in process).

A tiny pretrained-style folder per family (random weights, ``save_pretrained``, a BPE tokenizer trained on the
user's corpus saved next to it), the user's JSONL corpus in an overlay, one run per family."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tiny_models import FAMILIES, model_config

from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime import compat
from moeflow.settings import typed

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


def check_warmup_report(report: dict) -> None:
    """The warmup gate passed, judging against the folder's own base routing."""
    assert report["stable"] and report["thresholds"]["reference"] == "base" and report["base_layers"], report


def check_final_model(folder: Path, family: str, vocab_size: int) -> None:
    """The final model loads from its folder through transformers' own ``from_pretrained``, as its family."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.config.model_type == family and model.config.vocab_size == vocab_size
