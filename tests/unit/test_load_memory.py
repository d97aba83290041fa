"""The sharded loader's host memory on a folder in Step-3.5-Flash's published layout, whose stacked ``moe.*``
expert tensors transformers converts to the model's fused ``gate_up_proj`` (issue #36 item 3): the element
positions a rank places are computed a block of file rows at a time, never as one index per element of a whole
stacked tensor, and a load's peak resident set stays within the planner's load terms (the rank's weights and
one tensor's owned rows). Before, transformers' conversion made the broadcast probes contiguous and the loader
built int64 indices of whole tensors: about 40-55 GB per rank per expert tensor of the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from step3p5_folder import write_published_folder
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.loading.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel import rank_load
from moeflow.parallel.process_group import Ranks
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.counts import count_parameters
from moeflow.plan.memory import Job, phase_memory
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.settings import LoraSettings, TrainSettings
from moeflow.workflow.keys import training

pytestmark = pytest.mark.skipif(not compat.is_transformers_v5(), reason="Step-3.5-Flash needs transformers 5")

VOCAB, EXPERTS, EXPERT_FFN = 128, 64, 4096  # each stacked file tensor: 64 x 4096 x 32 (8.4M elements)
MODEL = {"attn_implementation": "eager", "experts_implementation": "eager", "config": {}}
ONE_RANK = Ranks(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("load-memory") / "step3p5"
    return write_published_folder(out, VOCAB, experts=EXPERTS, expert_ffn=EXPERT_FFN)


def sharded_load(folder: Path) -> torch.nn.Module:
    """``parallel.strategy: fsdp`` at one rank: built on the meta device, filled from the folder's files."""
    settings = typed(ModelSettings, MODEL | {"pretrained": str(folder)})
    parallel = typed(ParallelSettings, {"strategy": "fsdp"})
    train = typed(TrainSettings, training({"steps": 1, "lr": 1e-3, "method": "full"}))
    return make_model(settings, folder=folder, layout=Layout(ONE_RANK, parallel, train))


INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)  # not uint8: the byte views files are read through


class LargestIntegerTensor(TorchDispatchMode):
    """The most elements any index tensor made by an operation holds in its storage (a broadcast view: its
    base's, not its shape's)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype in INDEX_DTYPES and t.device.type != "meta":
                self.elements = max(self.elements, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_a_rank_places_a_stacked_tensor_by_blocks_without_a_whole_tensor_index(folder):
    stacked = EXPERTS * EXPERT_FFN * 32  # one file tensor (moe.gate_proj.weight of a layer)
    with LargestIntegerTensor() as largest:
        model = sharded_load(folder)
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert tuple(fused.shape) == (EXPERTS, 2 * EXPERT_FFN, 32)
    assert 0 < largest.elements <= rank_load.INDEX_BLOCK < stacked // 4, (largest.elements, stacked)


def test_a_loads_peak_resident_set_stays_within_the_planners_load_terms(folder, tmp_path):
    """In a fresh process that loaded a tiny folder first (every import and cache of a load done before the
    baseline), the load's peak above the baseline is at most the planner's load terms for one rank: its weights
    (fp32) and one tensor's owned rows (the read buffer)."""
    tiny = write_published_folder(tmp_path / "tiny", VOCAB)
    shape, params, _ = count_parameters(MODEL | {"pretrained": str(folder)}, VOCAB)
    job = Job(
        precision="fp32",
        method="full",
        micro_batch_size=1,
        seq_len=64,
        gradient_checkpointing=False,
        attn_implementation="eager",
        device="cuda",  # the host's read buffer is a term only there; on CPU the rank's one memory holds it
        num_devices=1,
        expert_parallel=False,
        lora=typed(LoraSettings, {}),
        loss_chunk_tokens=1024,
        ranks_per_node=1,
    )
    load = phase_memory(shape, params, job)["load"]
    planned = load["device"]["weights"] + load["host"]["read_buffer"]
    code = (
        "import gc, json, sys, pathlib\n"
        "sys.path.insert(0, 'tests'); sys.path.insert(0, 'tests/unit')\n"
        "import torch; torch.set_num_threads(1)\n"
        "import test_load_memory as t\n"
        "def kib(field):\n"
        "    line = next(l for l in open('/proc/self/status') if l.startswith(field + ':'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "t.sharded_load(pathlib.Path(sys.argv[2]))  # every import and cache of a load, before the baseline\n"
        "gc.collect()\n"
        "pathlib.Path('/proc/self/clear_refs').write_text('5')  # VmHWM := VmRSS\n"
        "base = kib('VmRSS')\n"
        "model = t.sharded_load(pathlib.Path(sys.argv[1]))\n"
        "print(json.dumps({'base': base, 'peak': kib('VmHWM')}))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(tiny)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    grew = got["peak"] - got["base"]
    assert grew <= planned, f"the load grew the resident set by {grew / 2**20:.0f} MiB, planned {planned / 2**20:.0f}"
