"""Benchmark: the coverage selection (greedy multi-cover + fill + random comparison) on synthetic statistics.

    python benchmarks/coverage.py                      # sizes up to 100,000 docs x 48 layers x 128 experts
    python benchmarks/coverage.py --sizes 1000x4x8     # docs x layers x experts, comma separated

Synthetic pool: top-8 routing with skewed expert popularity (Zipf, exponents 2.0 and 2.5, over a random expert order
per layer, each document boosting the experts of one of 16 topics), log-normal document lengths. A document meets a
cell with probability 1 - exp(-tokens * k * popularity). Generation is not timed; each size is selected
in a fresh process (2 BLAS threads); memory is the statistics (packed bits, token counts) plus the peak of
what the selection allocates (tracemalloc, in a second identical run). Goal at 100,000 x 48 x 128: at
most 5 s and 3 GB. Writes results/bench/coverage.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# benchmarks/tokenize.py would shadow the standard library's tokenize (numpy imports it): drop this folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

import numpy as np  # noqa: E402

from moeflow.coverage.bitsets import WORD, pack_word_bits  # noqa: E402
from moeflow.coverage.cover import Constraints, random_comparison, select_documents  # noqa: E402

DEFAULT_SIZES = "1000x48x128,10000x48x128,30000x48x128,100000x48x128"
TOP_K, PAIRS_PER_LAYER, MIN_DOCS, TOPICS = 8, 4, 5, 16


def synthetic_constraints(
    num_docs: int, num_layers: int, num_experts: int, zipf: float, seed: int = 0
) -> tuple[Constraints, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(np.log(256), 1.0, num_docs), 16, 8192).astype(np.int64)
    popularity = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf
    popularity = np.stack([popularity[rng.permutation(num_experts)] for _ in range(num_layers)])  # (L, E)
    boost = np.ones((TOPICS, num_layers, num_experts))
    for t in range(TOPICS):
        for layer in range(num_layers):
            boost[t, layer, rng.choice(num_experts, 8, replace=False)] = 20.0
    topic = rng.integers(0, TOPICS, num_docs)
    # the top pairs of a layer: pairs of its most popular experts
    best = np.argsort(-popularity, axis=1)[:, :4]
    pair_experts = np.sort(np.stack([best[:, [0, 0, 1, 0]], best[:, [1, 2, 2, 3]]], axis=-1), axis=-1)  # (L, 4, 2)
    num_constraints = num_layers * num_experts + num_layers * PAIRS_PER_LAYER
    words = np.zeros((num_docs, (num_constraints + WORD - 1) // WORD), dtype=np.uint64)
    available = np.zeros(num_constraints, dtype=np.int64)
    for start in range(0, num_docs, 2048):
        stop = min(start + 2048, num_docs)
        share = popularity[None] * boost[topic[start:stop]]
        share /= share.sum(axis=2, keepdims=True)  # (n, L, E) routing share per document
        picks = (tokens[start:stop] * TOP_K).astype(np.float64)[:, None, None]
        hit = 1.0 - np.exp(-picks * share)
        meets = rng.random(hit.shape, dtype=np.float32) < hit
        pa = np.take_along_axis(share, pair_experts[None, :, :, 0], 2)
        pb = np.take_along_axis(share, pair_experts[None, :, :, 1], 2)
        pair_hit = 1.0 - np.exp(-picks / TOP_K * np.minimum(1.0, TOP_K * (TOP_K - 1) * pa * pb))
        pair_meets = rng.random(pair_hit.shape, dtype=np.float32) < pair_hit
        dense = np.concatenate([meets.reshape(stop - start, -1), pair_meets.reshape(stop - start, -1)], axis=1)
        words[start:stop] = pack_word_bits(dense)
        available += dense.sum(axis=0)
    return Constraints(words, available, num_layers, num_experts, pair_experts.astype(np.int64)), tokens


def run_one(size: str, seed: int, budget: int, zipf: float) -> dict:
    num_docs, num_layers, num_experts = (int(x) for x in size.split("x"))
    constraints, tokens = synthetic_constraints(num_docs, num_layers, num_experts, zipf, seed)
    groups = np.zeros(num_docs, dtype=np.int64)
    stats_bytes = constraints.words.nbytes + constraints.available.nbytes + tokens.nbytes
    start = time.perf_counter()
    selection = select_documents(constraints, tokens, groups, MIN_DOCS, budget, seed)
    selected_s = time.perf_counter() - start
    comparison = random_comparison(constraints, tokens, selection.tokens, MIN_DOCS, draws=10, seed=seed)
    total_s = time.perf_counter() - start
    # Memory in a second, identical run: numpy's buffers are traced; the statistics are allocated before.
    tracemalloc.start()
    again = select_documents(constraints, tokens, groups, MIN_DOCS, budget, seed)
    selection_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(again.selected, selection.selected)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    got = constraints.column_counts(np.sort(selection.selected))
    cells = np.arange(constraints.num_constraints) < constraints.num_cells
    below = (got < MIN_DOCS) & constraints.valid
    return {
        "docs": num_docs,
        "layers": num_layers,
        "experts": num_experts,
        "top_k": TOP_K,
        "zipf": zipf,
        "pairs_per_layer": PAIRS_PER_LAYER,
        "min_docs_per_expert": MIN_DOCS,
        "token_budget": budget,
        "pool_tokens": int(tokens.sum()),
        "selection_seconds": round(selected_s, 3),
        "selection_plus_random_comparison_seconds": round(total_s, 3),
        "selection_peak_bytes": int(selection_peak),
        "statistics_bytes": int(stats_bytes),
        "process_peak_rss_bytes": int(peak),
        "selected_docs": int(len(selection.selected)),
        "greedy_docs": selection.greedy_count,
        "selected_tokens": selection.tokens,
        "valset_cells_below": int(below[cells].sum()),
        "valset_pairs_below": int(below[~cells].sum()),
        "pool_cells_below": int(((constraints.available < MIN_DOCS) & cells).sum()),
        "valset_unmet_for_budget": int(((selection.shortfall > 0) & constraints.valid).sum()),
        "random_cells_below_mean": comparison["cells_below"]["mean"],
        "random_pairs_below_mean": comparison["pairs_below"]["mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=262144, help="token budget of the validation set")
    parser.add_argument("--zipf", default="2.0,2.5", help="expert popularity skews (Zipf exponents), comma separated")
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "coverage.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.seed, args.budget, float(args.zipf))))
        return
    results = []
    for zipf, size in ((z, s) for z in args.zipf.split(",") for s in args.sizes.split(",")):
        command = [
            sys.executable,
            __file__,
            "--one",
            size,
            "--seed",
            str(args.seed),
            "--budget",
            str(args.budget),
            "--zipf",
            zipf,
        ]
        proc = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(
            f"zipf {zipf} {size}: select {result['selection_seconds']} s, "
            f"+random comparison {result['selection_plus_random_comparison_seconds']} s, "
            f"peak {(result['selection_peak_bytes'] + result['statistics_bytes']) / 2**30:.3f} GiB "
            f"(statistics {result['statistics_bytes'] / 2**30:.3f} GiB), "
            f"{result['selected_docs']} docs; "
            f"cells below: valset {result['valset_cells_below']}, random {result['random_cells_below_mean']}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "coverage selection on synthetic statistics",
        "goal": "100000 docs x 48 layers x 128 experts, top-8: <= 5 s and <= 3 GB on 2 cores",
        "cpu_count": os.cpu_count(),
        "threads": int(os.environ["OMP_NUM_THREADS"]),
        "numpy": np.__version__,
        "token_budget": args.budget,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
