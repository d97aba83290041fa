"""Per-rank memory of the phases that move the whole training state, before and after the sharded design.

Runs benchmarks/scale_worker.py under torchrun at 1, 2 and 4 gloo ranks (one thread each) with
``parallel.strategy: fsdp`` (and ``ep`` at 2 and 4 ranks on the current stack), once with this tree's
``src`` (the new design) and once with the baseline commit's (``--baseline-ref``, default 8d6d79c, the last
commit before the sharded checkpoints, loading and export: ``git archive``d into a temporary folder and put
first on PYTHONPATH), so the same worker measures both designs in one run. The model: the worker's qwen3_moe
of 238M parameters, fp32, AdamW (its moments made by a step on zero gradients), one measured step of 2 x 64
tokens a rank, saved once HF-sharded and reused.

Per run, phase and rank: peak RSS, RSS at the phase's start, seconds, CPU seconds, bytes written (scale_worker.py's
docstring). Every rank runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every allocation of 64 KiB
or more (every tensor that matters) with its own mmap and unmaps it when freed, instead of keeping freed
tensors in its heap (and raising its threshold as large blocks are freed), so RSS at a phase's end is what is
live and a phase's peak is its own, not the previous phase's leftovers.

The goal (issue #16): rank 0's peak RSS at 4 ranks at most 0.4x its peak at 1 rank in every phase, and no
rank above 1.2x the mean of the ranks. Writes this stack's entry of results/bench/scale.json
(``stacks.<stack>``; the other stack's is kept) and prints the Markdown tables of docs/benchmarks.md:

    PYTHONPATH=src .venvs/<stack>/bin/python benchmarks/scale.py [--worlds 1 2 4] [--designs baseline new]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "scale_worker.py"
RESULTS = REPO / "results" / "bench" / "scale.json"
MALLOC_MMAP_THRESHOLD = "65536"
PHASES = ("load", "step", "checkpoint", "resume", "export")
GOAL_RATIO, GOAL_SPREAD = 0.4, 1.2  # rank 0 at 4 ranks / at 1 rank; max rank / mean of the ranks
MIB = 2**20
GIB = 2**30


def stack_name() -> str:
    import transformers

    return "current" if int(transformers.__version__.split(".")[0]) >= 5 else "pinned"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(ref: str, into: Path) -> Path:
    """The baseline commit's ``src`` and ``config`` (its schema) under ``into``; its ``src``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src", "config"], check=True, capture_output=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def wait_for_memory(need: int, patience_s: float = 300.0) -> bool:
    """Whether ``need`` bytes are available, waiting up to ``patience_s`` for others on a shared host."""
    deadline = time.monotonic() + patience_s
    while mem_available() < need:
        if time.monotonic() > deadline:
            return False
        time.sleep(10)
    return True


def memory_needed(runs: list[dict], design: str, world: int, floor: int) -> int:
    """What a run at ``world`` ranks may take: the sum of the ranks' peaks in this design's run at the most ranks
    below ``world``, scaled to ``world`` ranks, at least ``floor`` (RSS counts shared file pages once per rank:
    an upper bound)."""
    smaller = [r for r in runs if r["design_run"] == design and "ranks" in r and r["world"] < world]
    if not smaller:
        return floor
    last = max(smaller, key=lambda r: r["world"])
    total = sum(max(n["peak_rss_bytes"] for n in rank.values()) for rank in last["ranks"])
    return max(floor, int(total * world / last["world"]))


def ensure_model(folder: Path, python: str) -> dict:
    """The benchmark model (scale_worker.py build), saved once per stack and reused."""
    if not (folder / "parameters.json").is_file():
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        subprocess.run([python, str(WORKER), "build", str(folder)], check=True, env=env)
    return json.loads((folder / "parameters.json").read_text())


def run_worker(
    python: str,
    src: Path,
    model: Path,
    out: Path,
    world: int,
    strategy: str,
    shard_size: str,
    timeout_s: float,
    method: str = "full",
) -> dict:
    """One torchrun of the worker: its phases.json, or the error it ended with."""
    env = {
        **os.environ,
        "PYTHONPATH": str(src),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": MALLOC_MMAP_THRESHOLD,
    }
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER), "run"]
    cmd += [str(model), str(out), "--strategy", strategy, "--export-shard-size", shard_size]
    cmd += ["--method", method]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"world": world, "strategy": strategy, "error": (proc.stdout + proc.stderr)[-4000:], "wall_s": wall}
    return {**json.loads((out / "phases.json").read_text()), "wall_s": wall}


# --------------------------------------------------------------------------- the table


def _find(runs: list[dict], design: str, strategy: str, world: int) -> dict | None:
    for r in runs:
        if r["design_run"] == design and r["strategy"] == strategy and r["world"] == world and "ranks" in r:
            return r
    return None


def peak(run: dict | None, phase: str, rank: int = 0) -> int | None:
    return None if run is None else run["ranks"][rank][phase]["peak_rss_bytes"]


def spread(run: dict | None, phase: str) -> float | None:
    """The largest rank's peak over the ranks' mean."""
    if run is None:
        return None
    peaks = [r[phase]["peak_rss_bytes"] for r in run["ranks"]]
    return max(peaks) / (sum(peaks) / len(peaks))


def goal(one: dict | None, four: dict | None) -> dict[str, dict]:
    """Per phase: rank 0's peak at 4 ranks / at 1 rank, the spread at 4 ranks, and whether both meet the goal."""
    out = {}
    for phase in PHASES:
        p1, p4, s4 = peak(one, phase), peak(four, phase), spread(four, phase)
        ratio = None if p1 is None or p4 is None else p4 / p1
        met = ratio is not None and ratio <= GOAL_RATIO and s4 <= GOAL_SPREAD
        out[phase] = {"ratio": ratio, "spread": s4, "met": met}
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(entry: dict) -> str:
    """docs/benchmarks.md's tables: peak RSS per phase (rank 0 at each world; ratio and spread at 4 ranks) per design,
    then per run the bytes each rank wrote for the checkpoint and the seconds of each phase."""
    runs, worlds = entry["runs"], entry["worlds"]
    top = max(worlds)
    lines = []
    for strategy in entry["strategies"]:
        one = {d: _find(runs, d, "fsdp", 1) for d in ("baseline", "new")}  # one process: the same with any layout
        lines += [
            f"**{entry['stack']} stack, {strategy}**: rank 0's peak RSS (MiB) at {' / '.join(map(str, worlds))} "
            f"ranks; at {top} ranks: rank 0 / one process, and the largest rank / the ranks' mean (goal: <= "
            f"{GOAL_RATIO}x and <= {GOAL_SPREAD}x)",
            "",
            f"| phase | baseline | {top}/1 | max/mean | new | {top}/1 | max/mean | goal met (new) |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        per_design = {}
        for design in ("baseline", "new"):
            at = {w: (one[design] if w == 1 else _find(runs, design, strategy, w)) for w in worlds}
            per_design[design] = (at, goal(at[1], at[top]))
        for phase in PHASES:
            cells = [phase]
            for design in ("baseline", "new"):
                at, g = per_design[design]
                cells += [" / ".join(_mib(peak(at[w], phase)) for w in worlds), _x(g[phase]["ratio"])]
                cells.append(_x(g[phase]["spread"]))
            cells.append("yes" if per_design["new"][1][phase]["met"] else "**no**")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Checkpoint bytes written per rank (MiB, rank 0 / the other ranks' largest) and seconds per phase "
        "(barrier to barrier):",
        "",
        "| design | layout | ranks | checkpoint written | load s | step s | checkpoint s | resume s | export s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted((r for r in runs if "ranks" in r), key=lambda r: (r["strategy"], r["world"], r["design_run"])):
        written = [rank["checkpoint"]["write_bytes"] for rank in r["ranks"]]
        others = _mib(max(written[1:])) if len(written) > 1 else "-"
        seconds = [f"{r['ranks'][0][p]['seconds']:.1f}" for p in PHASES]
        cells = [r["design_run"], r["strategy"], str(r["world"]), f"{_mib(written[0])} / {others}", *seconds]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in runs if "error" in r]
    for r in failed:
        errors = [line for line in r["error"].splitlines() if "Error:" in line and "elastic" not in line]
        last = errors[-1].strip() if errors else r["error"].strip().splitlines()[-1]
        lines.append(f"\nFailed: {r['design_run']} {r['strategy']} at {r['world']} ranks: {last}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--designs", nargs="+", choices=("baseline", "new"), default=["baseline", "new"])
    parser.add_argument("--baseline-ref", default="8d6d79c")
    parser.add_argument("--strategies", nargs="+", default=None, help="default: fsdp, and ep on the current stack")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a folder per stack under the temp dir")
    parser.add_argument("--export-shard-size", default="200MB")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--min-available-gib", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    stack = stack_name()
    strategies = args.strategies or (["fsdp", "ep"] if stack == "current" else ["fsdp"])
    python = sys.executable
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"moeflow-scale-model-{stack}"
    model = ensure_model(model_dir, python)
    import torch
    import transformers

    runs = []
    with tempfile.TemporaryDirectory(prefix="moeflow-scale-") as tmp:
        sources = {"new": REPO / "src", "baseline": baseline_tree(args.baseline_ref, Path(tmp) / "baseline")}
        for world in sorted(args.worlds):
            for strategy in strategies:
                if world == 1 and strategy != "fsdp":
                    continue  # one process: nothing to split (the fsdp run at 1 rank is every layout's reference)
                for design in args.designs:
                    need = memory_needed(runs, design, world, int(args.min_available_gib * GIB))
                    if not wait_for_memory(need):
                        error = f"skipped: {need / GIB:.1f} GiB needed, {mem_available() / GIB:.1f} GiB available"
                        runs.append({"world": world, "strategy": strategy, "design_run": design, "error": error})
                        print(f"{design} {strategy} at {world} rank(s): {error}", flush=True)
                        continue
                    out = Path(tmp) / f"{design}-{strategy}-{world}"
                    out.mkdir()
                    print(f"{design} {strategy} at {world} rank(s) ...", flush=True)
                    result = run_worker(
                        python, sources[design], model_dir, out, world, strategy, args.export_shard_size, args.timeout_s
                    )
                    result["design_run"] = design
                    runs.append(result)
                    print("  failed" if "error" in result else f"  {result['wall_s']:.0f} s", flush=True)
                    subprocess.run(["rm", "-rf", str(out)], check=True)  # ~3.6 GB of checkpoint and export
    entry = {
        "command": " ".join(
            ["PYTHONPATH=src python benchmarks/scale.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]
        ),
        "stack": stack,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB, 1),
            "platform": platform.platform(),
        },
        "threads_per_rank": 1,
        "malloc_mmap_threshold": MALLOC_MMAP_THRESHOLD,
        "model": {"config": "benchmarks/scale_worker.py MODEL_CONFIG", **model},
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--", "src", "benchmarks")),
        "baseline": {"ref": args.baseline_ref, "commit": git("rev-parse", args.baseline_ref)},
        "worlds": sorted(args.worlds),
        "strategies": strategies,
        "goal": {"rank0_ratio_at_most": GOAL_RATIO, "max_over_mean_at_most": GOAL_SPREAD},
        "runs": runs,
    }
    entry["goal_met"] = {
        strategy: goal(_find(runs, "new", "fsdp", 1), _find(runs, "new", strategy, max(args.worlds)))
        for strategy in strategies
    }
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"stacks": {}}
    report["stacks"][stack] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(entry))


if __name__ == "__main__":
    main()
