"""The multi-node launcher's rendezvous on one machine: ``moeflow.parallel.launch.torchrun_command(python, nodes=2,
cpu_ranks=1)`` run through bash as a SLURM job step would run it, with stand-in ``srun`` (one copy of its command
line per node, each with its SLURM_NODEID / SLURM_PROCID) and ``scontrol`` (the job's first host: 127.0.0.1). Two
torchrun agents meet at a c10d rendezvous on 127.0.0.1 and start one gloo rank each: 2 nodes x 1 rank.

What a real SLURM does with the command (one agent per node of the allocation, their GPUs, the node list from
squeue inside the executor plugin's jobstep) is tests/pipeline/test_slurm.py's; its emulated nodes share one host
under names that do not resolve, so the rendezvous and the training across agents are checked here.

They resume a tiny model's FSDP training from a checkpoint written on 1 node x 2 ranks (``torchrun
--standalone``) through ``Trainer.save`` / ``Trainer.load`` (whatever checkpoint format moeflow writes), and
their losses are the uninterrupted 1 x 2 run's.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a torchrun script: tiny_models, tiny_training

from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, packed_rows  # noqa: E402
from tiny_training import settings as train_settings  # noqa: E402

from moeflow.data.collate import collate
from moeflow.loading.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel.launch import torchrun_command
from moeflow.parallel.layouts import is_sharded
from moeflow.parallel.process_group import check_ranks, gather_objects, init, teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime.stage import KILL_ENV
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.trainer import Trainer

RANKS = 2
STEPS, SAVED_AT = 4, 2
JOB_ID = "4242"
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NODEID", "SLURM_PROCID")

# srun as a job step runs it: --nodes N copies of the command line, one per node, each told its node; waits for all.
FAKE_SRUN = f"""#!{sys.executable}
import os, subprocess, sys
args, nodes = sys.argv[1:], 1
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if flag == "--nodes":
        nodes = int(args.pop(0))
    elif flag == "--ntasks-per-node":
        assert args.pop(0) == "1", "one task (one torchrun agent) per node"
    elif flag == "--cpus-per-task":
        args.pop(0)
    elif flag != "--overlap":
        sys.exit(f"stand-in srun: unexpected option {{flag}}")
env = lambda node: {{**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}}
procs = [subprocess.Popen(args, env=env(node)) for node in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stand_in_slurm(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        path = folder / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def launch(command: str, mode: str, model_dir: Path, out: Path, extra_env: dict | None = None) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    env.pop(KILL_ENV, None)
    line = f"{command} {shlex.join([__file__, mode, str(model_dir), str(out)])}"
    proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_two_nodes_of_one_rank_resume_a_one_node_two_rank_checkpoint(tmp_path):
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings

    model_dir = tmp_path / "model"
    make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=5).save_pretrained(model_dir)
    one_node = torchrun_command(sys.executable, cpu_ranks=RANKS)
    launch(one_node, "straight", model_dir, tmp_path)

    two_nodes = torchrun_command(sys.executable, nodes=2, cpu_ranks=1, port=free_port())
    assert two_nodes.startswith("srun --overlap --nodes 2 --ntasks-per-node 1 --cpus-per-task 1 ")
    assert "--nproc_per_node 1" in two_nodes
    slurm = {
        "PATH": f"{stand_in_slurm(tmp_path / 'slurm-bin')}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_JOB_ID": JOB_ID,
    }
    launch(two_nodes, "resume", model_dir, tmp_path, slurm)

    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    # two agents of one rank each, on the two "nodes" srun started, in one world of two ranks
    ranks = resumed["ranks"]
    assert sorted(r["RANK"] for r in ranks) == ["0", "1"] and {r["WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"1"} and {r["LOCAL_RANK"] for r in ranks} == {"0"}
    assert sorted(r["GROUP_RANK"] for r in ranks) == ["0", "1"]
    assert sorted(r["SLURM_NODEID"] for r in ranks) == ["0", "1"]
    assert {r["SLURM_NODEID"] for r in straight["ranks"]} == {None}  # the 1 x 2 run: torchrun --standalone
    assert resumed["continued_from"] == SAVED_AT and resumed["sharded"] and straight["sharded"]
    after = lambda report: [loss for loss in report["losses"] if loss[0] > SAVED_AT]  # noqa: E731
    assert [step for step, *_ in after(resumed)] == list(range(SAVED_AT + 1, STEPS + 1))
    assert after(resumed) == after(straight)  # CPU, the same world size: bit for bit


# --------------------------------------------------------------------------- one rank (run by torchrun)


def _main(mode: str, model_dir: str, out: str) -> None:
    """``straight``: train STEPS steps on 1 node x 2 ranks, saving a checkpoint after step SAVED_AT;
    ``resume``: on 2 nodes x 1 rank, load that checkpoint and train to STEPS. Rank 0 writes OUT/<mode>.json."""
    torch.set_num_threads(1)
    ranks = init("cpu")
    nodes = 1 if mode == "straight" else 2
    parallel = typed(ParallelSettings, {"strategy": "fsdp", "nproc_per_node": RANKS // nodes, "nnodes": nodes})
    layout = check_ranks(parallel, ranks)
    settings = train_settings(steps=STEPS)
    model = make_model(typed(ModelSettings, tiny_model_cfg()), folder=model_dir, layout=Layout(ranks, layout, settings))
    trainer = Trainer(model, settings, packed_rows(), collate_fn=collate, seed=0)
    checkpoint = Path(out) / "checkpoint"
    if mode == "straight":
        trainer.run(until=SAVED_AT)
        trainer.save(checkpoint)
    else:
        trainer.load(checkpoint)
    continued_from = trainer.step
    trainer.run()
    report = {
        "continued_from": continued_from,
        "sharded": is_sharded(trainer.model),
        "losses": [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.train_records()],
        "ranks": gather_objects({k: os.environ.get(k) for k in RANK_ENV}),
    }
    if ranks.is_main:
        (Path(out) / f"{mode}.json").write_text(json.dumps(report))
    teardown()


if __name__ == "__main__":
    _main(*sys.argv[1:4])
