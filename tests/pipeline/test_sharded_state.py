"""Sharded loading and the streamed export on two CPU ranks (gloo, started by torchrun).

* ``parallel.strategy: fsdp``: ``moeflow.loading.factory.make_model`` builds the model on the meta device,
  shards it and reads each rank's rows from the folder's files; the gathered weights equal a whole
  ``from_pretrained`` load exactly, for tied and untied embeddings, from one ``model.safetensors`` and
  from an HF-sharded folder (index + several files).
* ``moeflow.checkpoint.export.save_final_model`` on the sharded model (fsdp; ep on transformers 5) writes an
  HF-sharded folder that ``from_pretrained`` loads with the ranks' (changed) weights, within
  ``max_shard_size``, and rank 0's writer is fed one gathered tensor at a time.

For CI's time the fsdp load and the fsdp export share one torchrun launch (module fixture ``launched``).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a torchrun script: tiny_models

from tiny_models import tiny_model_cfg  # noqa: E402

from moeflow.checkpoint import export
from moeflow.loading.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel import dtensors
from moeflow.parallel.launch import torchrun_command
from moeflow.parallel.layouts import full_state_dict, is_sharded
from moeflow.parallel.process_group import Ranks, init, teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.runtime.stage import KILL_ENV
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.settings import TrainSettings
from moeflow.workflow.keys import training

RANKS = 2
VOCAB = 96
SHARD_BYTES = 20_000  # several files for the tiny model; the embedding (96 x 32 fp32 = 12 KB) fits
FOLDERS = {"tied": True, "untied": False}
LAYOUTS = ["fsdp"] + (["ep"] if compat.is_transformers_v5() else [])


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny qwen3_moe folders: tied and untied embeddings, one file; untied in several files (HF index)."""
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings

    root = tmp_path_factory.mktemp("sharded-state")
    folders = {}
    for kind, tied in FOLDERS.items():
        model = make_model(typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=tied)), vocab_size=VOCAB, seed=7)
        model.save_pretrained(root / kind)
        if not tied:
            model.save_pretrained(root / "untied-sharded", max_shard_size="20KB")
            folders["untied-sharded"] = root / "untied-sharded"
        folders[kind] = root / kind
    assert (folders["untied-sharded"] / "model.safetensors.index.json").is_file()
    return folders


def run_ranks(jobs: dict, out: Path) -> None:
    """One torchrun launch of 2 ranks running ``jobs`` ({"load" | "export": its job}) in one process group;
    each writes under ``out/<command>``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop(KILL_ENV, None)
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=RANKS)) + [__file__, json.dumps(jobs), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


LOAD_KINDS = ["tied", "untied", "untied-sharded"]


@pytest.fixture(scope="module")
def launched(saved_models, tmp_path_factory):
    """A layout's rank outputs, from one torchrun launch per layout: fsdp loads and exports, ep exports."""
    folders = {}

    def launch(layout: str) -> Path:
        if layout not in folders:
            out = tmp_path_factory.mktemp(f"ranks-{layout}")
            jobs = {"export": {"model": str(saved_models["untied"]), "layout": layout}}
            if layout == "fsdp":
                jobs = {"load": {k: str(saved_models[k]) for k in LOAD_KINDS}} | jobs
            run_ranks(jobs, out)
            folders[layout] = out
        return folders[layout]

    return launch


def whole_load(folder: Path) -> dict[str, torch.Tensor]:
    from moeflow.loading.factory import make_model
    from moeflow.model.settings import ModelSettings

    return make_model(typed(ModelSettings, tiny_model_cfg()), folder=folder).state_dict()


def test_fsdp_ranks_load_their_rows_exactly_as_a_whole_load(saved_models, launched):
    from safetensors.torch import load_file

    out = launched("fsdp") / "load"
    for kind in LOAD_KINDS:
        got = load_file(str(out / f"{kind}.safetensors"))
        want = whole_load(saved_models[kind])
        want = {k: v for k, v in want.items() if k in got or k != "lm_head.weight"}  # tied: saved once
        assert sorted(got) == sorted(want), kind
        assert all(torch.equal(got[k], want[k]) for k in want), kind


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_export_streams_a_folder_from_pretrained_loads_with_the_trained_weights(saved_models, launched, layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = saved_models["untied"]
    out = launched(layout) / "export"
    folder = out / "export"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in folder.glob("model-*.safetensors"))
    sizes = {f: (folder / f).stat().st_size for f in files}
    tensor_bytes = {}
    for name, file in index["weight_map"].items():
        tensor_bytes.setdefault(file, []).append(name)
    for file in files:
        data = sum(t.numel() * t.element_size() for t in load_file(str(folder / file)).values())
        assert data <= SHARD_BYTES or len(tensor_bytes[file]) == 1, (file, data)
        assert sizes[file] > data
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in files for t in load_file(str(folder / f)).values()
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["use_cache"] is True and "distributed_config" not in config
    trained = load_file(str(out / "trained.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    base = whole_load(source)
    assert not any(torch.equal(base[k], trained[k]) for k in trained if trained[k].is_floating_point())
    # rank 0's writer gets each gathered tensor's pieces before the next tensor is gathered
    events = json.loads((out / "events.json").read_text())
    gathered = [e for e in events if e[0] == "gather"]
    assert len(gathered) == len({n for kind, n in events if kind == "gather"}) > 10
    for i, (kind, _) in enumerate(events[:-1]):
        if kind == "gather":
            assert events[i + 1][0] == "write", events[i : i + 3]
    if (
        compat.fsdp2_available()
    ):  # FSDP2's and ep's row shards (2-D under ep) are sent to rank 0, made whole nowhere else
        assert len([n for _, n in gathered if n.startswith("rows:")]) > 10, gathered
        assert not [n for _, n in gathered if n.endswith("dtensor")], gathered


# --------------------------------------------------------------------------- one rank (run by torchrun)


def _train_settings() -> TrainSettings:
    return typed(TrainSettings, training({"steps": 1, "lr": 1e-3}))


def _load(folders: dict[str, str], out: Path, ranks: Ranks) -> None:
    layout = typed(ParallelSettings, {"strategy": "fsdp", "nproc_per_node": RANKS})
    for kind, folder in folders.items():
        model = make_model(
            typed(ModelSettings, tiny_model_cfg()), folder=folder, layout=Layout(ranks, layout, _train_settings())
        )
        assert is_sharded(model)
        weights, _ = full_state_dict(model)
        if ranks.is_main:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{kind}.safetensors"))


def _export(job: dict, out: Path, ranks: Ranks) -> None:
    from safetensors.torch import save_file

    section = {"strategy": job["layout"], "nproc_per_node": RANKS} | (
        {"ep_size": RANKS} if job["layout"] == "ep" else {}
    )
    layout = typed(ParallelSettings, section)
    model = make_model(
        typed(ModelSettings, tiny_model_cfg()), folder=job["model"], layout=Layout(ranks, layout, _train_settings())
    )
    with torch.no_grad():  # "trained": every weight changed, the same way on every rank
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    trained, _ = full_state_dict(model)
    events: list[tuple[str, str]] = []
    gather, write = (export._whole_on_rank0, export._whole, export._rows_on_rank0), export.ShardedWriter.write
    export._whole_on_rank0 = lambda p, t: (events.append(("gather", t.name)), gather[0](p, t))[1]
    kind = lambda t: "dtensor" if dtensors.is_dtensor(t) else ""  # noqa: E731
    export._whole = lambda t: (events.append(("gather", f"#{len(events)}{kind(t)}")), gather[1](t))[1]
    export._rows_on_rank0 = lambda t: (events.append(("gather", f"rows:{len(events)}")), gather[2](t))[1]
    export.ShardedWriter.write = lambda self, n, t: (events.append(("write", n)), write(self, n, t))[1]
    try:
        export.save_final_model(model, None, out / "export", max_shard_size=SHARD_BYTES)
    finally:
        export._whole_on_rank0, export._whole, export._rows_on_rank0 = gather
        export.ShardedWriter.write = write
    if ranks.is_main:
        save_file({k: v.contiguous() for k, v in trained.items()}, str(out / "trained.safetensors"))
        (out / "events.json").write_text(json.dumps(events))


def _main(jobs_json: str, out: str) -> None:
    torch.set_num_threads(1)
    ranks = init("cpu")
    for command, job in json.loads(jobs_json).items():
        folder = Path(out) / command
        folder.mkdir(parents=True, exist_ok=True)
        {"load": _load, "export": _export}[command](job, folder, ranks)
    teardown()


if __name__ == "__main__":
    _main(*sys.argv[1:3])
