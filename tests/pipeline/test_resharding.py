"""Checkpoints saved by N ranks resume at M ranks and in another layout (gloo, tiny models, torchrun).

One step, a checkpoint, then the step after it: the run that saved continues (the uninterrupted run), and
the resumed runs load the checkpoint into another world size or layout: 2->1, 1->2 and 2->4 with ``fsdp``,
fsdp(2)->none(1), and on the current stack ep(2)->fsdp(2). The global batch is the same in every run
(``micro_batch_size`` 1 x ``grad_accum_steps`` x world = 4 rows) and so is the loss's chunking, so the
resumed whole state (gathered with ``moeflow.parallel.layouts.full_state_dict``) equals the saved one exactly and the
next step's loss equals the uninterrupted run's within 1e-6 relative. Also: every rank's file holds only
its shards (``fsdp``: about 1/world of the state each; ``none``: the ranks split the writes), and two ranks
killed between their writes and the rename resume from the previous checkpoint with the same losses.
Four torchrun launches in all (the ``resharded`` fixture): the kill and the runs before and after it ride
along in the launches of the resharding cases, since each launch costs every rank an interpreter's imports.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a torchrun script: tiny_models, tiny_training

from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, packed_rows, settings  # noqa: E402

from moeflow.checkpoint.state import latest_checkpoint, partial_folder, step_folder  # noqa: E402
from moeflow.data.collate import collate  # noqa: E402
from moeflow.loading.factory import Layout, make_model  # noqa: E402
from moeflow.model.safetensors_files import read_header  # noqa: E402
from moeflow.model.settings import ModelSettings  # noqa: E402
from moeflow.parallel.launch import torchrun_command  # noqa: E402
from moeflow.parallel.layouts import full_state_dict
from moeflow.parallel.process_group import Ranks, init, teardown
from moeflow.parallel.settings import ParallelSettings  # noqa: E402
from moeflow.runtime import compat  # noqa: E402
from moeflow.runtime.stage import KILL_ENV  # noqa: E402
from moeflow.settings import (
    REPO_ROOT,  # noqa: E402
    typed,
)
from moeflow.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.pipeline

GLOBAL_ROWS = 4
CHUNK_TOKENS = 16  # the same cross-entropy chunks in every run
EP = compat.is_transformers_v5()


def train_settings(world: int, **extra):
    return settings(
        steps=3,
        micro_batch_size=1,
        grad_accum_steps=GLOBAL_ROWS // world,
        balance={"mode": "exact", "coef": 0.01, "z_loss_coef": 0.001},
        **extra,
    )


def make_trainer(model_dir: Path, layout: str, ranks: Ranks, checkpoint_dir: str | None = None, **extra) -> Trainer:
    parallel = typed(
        ParallelSettings,
        {"strategy": layout, "nproc_per_node": ranks.world_size}
        | ({"ep_size": ranks.world_size} if layout == "ep" else {}),
    )
    s = train_settings(ranks.world_size, **extra)
    model_settings = typed(ModelSettings, {**tiny_model_cfg(), "loss_chunk_tokens": CHUNK_TOKENS})
    model = make_model(model_settings, folder=model_dir, layout=Layout(ranks, parallel, s))
    return Trainer(model, s, packed_rows(), collate_fn=collate, seed=0, checkpoint_dir=checkpoint_dir)


def whole_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and every optimizer tensor (both AdamW moments, the step) by name, on every rank."""
    weights, optim = full_state_dict(trainer.model, trainer.optimizer)
    flat = {f"model/{k}": v for k, v in weights.items()}
    flat.update({f"optimizer/{n}/{k}": v for n, s in optim["state"].items() for k, v in s.items()})
    return {k: v.detach().clone().contiguous() for k, v in flat.items()}


def run_ranks(world: int, out: Path, models: dict[str, Path], ops: list[dict]):
    """One torchrun launch running ``ops`` in order on ``world`` ranks (an op with ``kill_at`` sets
    ``MOEFLOW_KILL_AT`` for itself: nothing after it runs)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop(KILL_ENV, None)
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=world)) + [
        __file__,
        str(out),
        json.dumps({k: str(v) for k, v in models.items()}),
        json.dumps(ops),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def run_ok(world: int, out: Path, models: dict[str, Path], ops: list[dict]) -> None:
    proc = run_ranks(world, out, models, ops)
    assert proc.returncode == 0, f"{world} ranks, {ops} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings
    from moeflow.settings import typed

    root = tmp_path_factory.mktemp("reshard-models")
    folders = {}
    for kind in ("tied", "untied"):  # transformers 5's expert parallelism refuses tied embeddings
        cfg = tiny_model_cfg()
        cfg["config"]["tie_word_embeddings"] = kind == "tied"
        folders[kind] = root / kind
        make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=5).save_pretrained(folders[kind])
    return folders


@pytest.fixture(scope="module")
def resharded(models, tmp_path_factory) -> Path:
    """Every save and resume of this module, the kill during a save included, in four torchrun launches (2, 1, 2
    and 4 ranks): a launch costs each rank an interpreter's imports. The first launch ends with the kill (its
    op sets ``MOEFLOW_KILL_AT`` for itself), after its saves; what the kill left is recorded in ``killed.json``
    before the third launch resumes it."""
    out = tmp_path_factory.mktemp("reshard")
    checkpoints = out / "killed-checkpoints"
    train = {"op": "train", "layout": "fsdp", "model": "tied", "name": "resumed", "checkpoints": str(checkpoints)}
    first = [{"op": "save", "layout": "fsdp", "model": "tied", "name": "fsdp2"}]
    first += [{"op": "save", "layout": "none", "model": "tied", "name": "none2"}]
    first += [{"op": "save", "layout": "ep", "model": "untied", "name": "ep2"}] if EP else []
    first += [{"op": "train", "layout": "fsdp", "model": "tied", "name": "straight", "until": 3}]
    first += [{**train, "until": 2}]  # saves step 1 (the last step is not checkpointed)
    first += [{**train, "until": 3, "kill_at": "checkpoint.save"}]  # rank 0 dies before renaming step 2's
    killed = run_ranks(2, out, models, first)
    before_kill = [out / op["name"] / "report.json" for op in first if op["op"] == "save"]
    before_kill += [out / "straight" / "losses.json", out / "resumed" / "losses.json"]
    assert all(f.is_file() for f in before_kill), f"the first launch failed before its kill:\n{killed.stderr[-6000:]}"
    left = {
        "returncode": killed.returncode,
        "partial_shard_1": (partial_folder(step_folder(checkpoints, 2)) / "shard-1.safetensors").is_file(),
        "latest": str(latest_checkpoint(checkpoints)),
        "step_1": str(step_folder(checkpoints, 1)),
    }
    (out / "killed.json").write_text(json.dumps(left))
    (out / "resumed" / "losses.json").unlink()  # written again by the resumed run
    run_ok(
        1,
        out,
        models,
        [
            {"op": "resume", "layout": "fsdp", "model": "tied", "name": "fsdp2-fsdp1", "source": "fsdp2"},
            {"op": "resume", "layout": "none", "model": "tied", "name": "fsdp2-none1", "source": "fsdp2"},
            {"op": "save", "layout": "fsdp", "model": "tied", "name": "fsdp1"},
        ],
    )
    second = [{"op": "resume", "layout": "fsdp", "model": "tied", "name": "fsdp1-fsdp2", "source": "fsdp1"}]
    second += (
        [{"op": "resume", "layout": "fsdp", "model": "untied", "name": "ep2-fsdp2", "source": "ep2"}] if EP else []
    )
    second += [{**train, "until": 3}]  # the killed run resumed
    run_ok(2, out, models, second)
    run_ok(
        4, out, models, [{"op": "resume", "layout": "fsdp", "model": "tied", "name": "fsdp2-fsdp4", "source": "fsdp2"}]
    )
    return out


CASES = [("fsdp2", "fsdp1"), ("fsdp2", "none1"), ("fsdp1", "fsdp2"), ("fsdp2", "fsdp4")] + (
    [("ep2", "fsdp2")] if EP else []
)


@pytest.mark.parametrize(("saved", "resumed"), CASES, ids=[f"{a}->{b}" for a, b in CASES])
def test_a_checkpoint_resumes_at_another_world_size_and_layout_exactly(resharded, saved, resumed):
    from safetensors.torch import load_file

    name = f"{saved}-{resumed}"
    want = load_file(str(resharded / saved / "state.safetensors"))
    got = load_file(str(resharded / name / "state.safetensors"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert any(k.endswith("/exp_avg_sq") for k in want) and any(k.endswith("/step") for k in want)
    uninterrupted = json.loads((resharded / saved / "report.json").read_text())
    report = json.loads((resharded / name / "report.json").read_text())
    assert report["step"] == 2 and report["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-6, abs=0)


def _shard_bytes(checkpoint: Path) -> list[int]:
    sizes = []
    for rank in range(len(list(checkpoint.glob("shard-*.safetensors")))):
        entries, _ = read_header(checkpoint / f"shard-{rank}.safetensors")
        sizes.append(sum(e.end - e.start for e in entries.values()))
    return sizes


@pytest.mark.parametrize("layout", ["fsdp", "none"])
def test_every_rank_writes_only_its_share_of_the_state(resharded, layout):
    """fsdp: each rank's file holds its shards, about half the state; none: the ranks split the writes.
    Every tensor is written once (a tied one too): the files hold the whole state's bytes, no more."""
    from safetensors.torch import load_file

    state = load_file(str(resharded / f"{layout}2" / "state.safetensors"))
    tied = "model/lm_head.weight", "model/model.embed_tokens.weight"
    if all(k in state for k in tied) and torch.equal(*(state[k] for k in tied)):
        del state[tied[0]]  # the tied output layer is the embedding: one tensor, written once
    total = sum(t.numel() * t.element_size() for t in state.values())
    sizes = _shard_bytes(resharded / f"{layout}2" / "checkpoint")
    assert len(sizes) == 2 and sum(sizes) == total
    assert all(0.35 * total <= size <= 0.65 * total for size in sizes), (sizes, total)


def test_two_ranks_killed_during_a_save_resume_from_the_previous_checkpoint(resharded):
    """Killed (rank 0, SIGKILL) between the ranks' writes and the rename of step 2's checkpoint: step 1's is
    the newest, and the run resumed from it gives the uninterrupted run's losses."""
    left = json.loads((resharded / "killed.json").read_text())
    assert left["returncode"] != 0
    assert left["partial_shard_1"]
    assert left["latest"] == left["step_1"]
    straight = json.loads((resharded / "straight" / "losses.json").read_text())
    assert json.loads((resharded / "resumed" / "losses.json").read_text()) == straight


# --------------------------------------------------------------------------- the ranks (run by torchrun)


def _save(trainer: Trainer, folder: Path, ranks: Ranks) -> None:
    from safetensors.torch import save_file

    state = whole_state(trainer)
    if ranks.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / "state.safetensors"))


def _report(trainer: Trainer, folder: Path, ranks: Ranks) -> None:
    record = trainer.train_records()[-1]
    if ranks.is_main:
        (folder / "report.json").write_text(json.dumps({"step": record["step"], "loss": record["loss"]}))


def _main(out: str, models_json: str, ops_json: str) -> None:
    torch.set_num_threads(1)
    out, models = Path(out), {k: Path(v) for k, v in json.loads(models_json).items()}
    ranks = init("cpu")
    for op in json.loads(ops_json):
        folder = out / op["name"]
        if "kill_at" in op:
            os.environ[KILL_ENV] = op["kill_at"]
        if op["op"] == "train":  # checkpoint every step, losses of every step
            checkpoints = op.get("checkpoints")
            trainer = make_trainer(models[op["model"]], op["layout"], ranks, checkpoints, checkpoint_every=1)
            trainer.resume()
            trainer.run(until=op["until"])
            if ranks.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                losses = [[r["step"], r["loss"]] for r in trainer.train_records()]
                (folder / "losses.json").write_text(json.dumps(losses))
            continue
        trainer = make_trainer(models[op["model"]], op["layout"], ranks)
        if op["op"] == "save":
            trainer.run(until=1)
            trainer.save(folder / "checkpoint")
        else:
            trainer.load(out / op["source"] / "checkpoint")
        _save(trainer, folder, ranks)
        trainer.run(until=2)
        _report(trainer, folder, ranks)
    teardown()


if __name__ == "__main__":
    _main(*sys.argv[1:4])
