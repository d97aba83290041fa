"""Tokenization throughput on the default corpus, three ways, same tokenizer, same cores, one process:

1. ``moeflow_stage``: this pipeline's tokenize stage (``moeflow.data.sharding.tokenize_corpus``) from the
   source files to packed Arrow shards and manifest (reading, hashing, splitting, packing, writing);
2. ``datasets_map``: the usual recipe, ``Dataset.map(tokenize, batched=True, num_proc=N)`` then a
   second ``map`` that concatenates and chunks into seq_len blocks (transformers' run_clm ``group_texts``),
   starting from the texts already in memory;
3. ``raw_tokenizer``: the ``tokenizer(batch)`` call alone on the in-memory texts (an upper bound).

    PYTHONPATH=src python benchmarks/tokenization.py [--threads 2] [--repeats 2] [--tokenizer DIR]

Writes results/bench/tokenize.json: tokens/s of each, and the stage's ratios to the other two
(goals: >= 1.5x datasets_map, >= 0.8x raw_tokenizer). Best of ``--repeats`` runs each.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moeflow.data.corpus import SourceReader, split_documents  # noqa: E402
from moeflow.data.sharding import TokenizeStage, tokenize_corpus  # noqa: E402
from moeflow.data.tokenizer import load_fast_tokenizer, set_tokenizer_threads, train_tokenizer_stage  # noqa: E402
from moeflow.runtime import compat  # noqa: E402
from moeflow.runtime.files import write_json  # noqa: E402
from moeflow.runtime.stage import set_offline  # noqa: E402
from moeflow.settings import typed  # noqa: E402
from moeflow.workflow.keys import data_settings  # noqa: E402
from moeflow.workflow.load import load, run_config  # noqa: E402
from moeflow.workflow.merge import run_names  # noqa: E402


def best_of(repeats, fn):
    """(seconds, tokens) of the fastest of ``repeats`` calls of fn() -> tokens."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        runs.append((time.perf_counter() - start, tokens))
    return min(runs)


def corpus_texts(settings, corpora):
    """The documents the stage tokenizes (same filtering, deduplication), as plain strings."""
    data = settings.data
    texts = []
    for name in corpora:
        reader = SourceReader(name, data["sources"][name], data["on_bad_record"])
        texts += [doc.text for _, _, doc in split_documents(reader, data["split"])]
    return texts


def run_stage(settings, corpora, tokenizer_dir, threads, workdir):
    tokens = 0
    for name in corpora:
        manifest = tokenize_corpus(name, settings, tokenizer_dir, Path(workdir) / name, threads=threads)
        tokens += manifest["totals"]["tokens"]
    return tokens


def run_datasets_recipe(texts, tokenizer, seq_len, threads):
    import datasets

    def tokenize(batch):
        return tokenizer(batch["text"])

    def group_texts(examples):
        # transformers' examples/pytorch/language-modeling/run_clm.py
        concatenated = {k: sum(examples[k], []) for k in examples}
        total = (len(concatenated["input_ids"]) // seq_len) * seq_len
        result = {k: [t[i : i + seq_len] for i in range(0, total, seq_len)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    ds = datasets.Dataset.from_dict({"text": texts})
    tokenized = ds.map(tokenize, batched=True, num_proc=threads, remove_columns=["text"])
    tokens = sum(len(ids) for ids in tokenized["input_ids"])
    tokenized.map(group_texts, batched=True, num_proc=threads)
    return tokens


def run_raw(texts, tokenizer, batch_size=1000):
    tokens = 0
    for i in range(0, len(texts), batch_size):
        tokens += sum(len(ids) for ids in tokenizer(texts[i : i + batch_size])["input_ids"])
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="cores for every method (default 2)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokenizer", help="tokenizer folder (default: train the default config's tokenizer first)")
    parser.add_argument(
        "--config", action="append", default=[], help="config overlay(s) (default: the embedded default)"
    )
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "tokenize.json"))
    args = parser.parse_args()

    set_offline()
    set_tokenizer_threads(args.threads)  # before the first parallel batch: the Rust pool is created once
    import datasets

    datasets.disable_progress_bars()
    cfg = load(*args.config)
    run_cfg = run_config(cfg, run_names(cfg)[0])
    settings = typed(TokenizeStage, data_settings(run_cfg))
    corpora = sorted(settings.data["sources"])
    seq_len = settings.data["seq_len"]

    with tempfile.TemporaryDirectory(prefix="moeflow-bench-") as workdir:
        tokenizer_dir = args.tokenizer
        trained = None
        if not tokenizer_dir:
            tokenizer_dir = str(Path(workdir) / "tokenizer")
            start = time.perf_counter()
            train_tokenizer_stage(settings.tokenizer, tokenizer_dir, threads=args.threads)
            trained = time.perf_counter() - start
        tokenizer = load_fast_tokenizer(tokenizer_dir)
        texts = corpus_texts(settings, corpora)
        results = {}
        results["raw_tokenizer"] = best_of(args.repeats, lambda: run_raw(texts, tokenizer))
        results["moeflow_stage"] = best_of(
            args.repeats, lambda: run_stage(settings, corpora, tokenizer_dir, args.threads, Path(workdir) / "stage")
        )
        with tempfile.TemporaryDirectory(prefix="moeflow-bench-cache-") as cache:
            datasets.config.HF_DATASETS_CACHE = cache
            results["datasets_map"] = best_of(
                args.repeats, lambda: run_datasets_recipe(texts, tokenizer, seq_len, args.threads)
            )

    methods = {
        name: {"seconds": round(s, 3), "tokens": n, "tokens_per_s": round(n / s)} for name, (s, n) in results.items()
    }
    stage = methods["moeflow_stage"]["tokens_per_s"]
    ratios = {
        "stage_vs_datasets_map": round(stage / methods["datasets_map"]["tokens_per_s"], 3),
        "stage_vs_raw_tokenizer": round(stage / methods["raw_tokenizer"]["tokens_per_s"], 3),
    }
    report = {
        "methods": methods,
        "ratios": ratios,
        "goals": {
            "stage_vs_datasets_map >= 1.5": ratios["stage_vs_datasets_map"] >= 1.5,
            "stage_vs_raw_tokenizer >= 0.8": ratios["stage_vs_raw_tokenizer"] >= 0.8,
        },
        "corpus": {"corpora": corpora, "documents": len(texts), "characters": sum(map(len, texts)), "seq_len": seq_len},
        "tokenizer": {"vocab_size": len(tokenizer), "trained_seconds": None if trained is None else round(trained, 3)},
        "threads": args.threads,
        "repeats": args.repeats,
        "environment": {
            "python": platform.python_version(),
            "transformers": str(compat.version_of("transformers")),
            "tokenizers": str(compat.version_of("tokenizers")),
            "datasets": str(compat.version_of("datasets")),
            "cpu_count": os.cpu_count(),
        },
    }
    write_json(args.out, report)
    for name, m in methods.items():
        print(f"{name:15s} {m['tokens_per_s']:>12,} tokens/s  ({m['tokens']:,} tokens in {m['seconds']:.2f} s)")
    print(
        f"stage / datasets.map = {ratios['stage_vs_datasets_map']:.2f}x   "
        f"stage / raw tokenizer = {ratios['stage_vs_raw_tokenizer']:.2f}x"
    )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
