"""Whether a run's exported model serves as it was trained: a serving engine's log-probs against moeflow's.

Rule serve_check loads the exported folder twice: with moeflow's own loader (the model the run trained and evaluated)
and in vLLM, started in the serving environment's Python (moeflow.serving.engine). Both score every segment of the
coverage validation set, so every expert serves some of its tokens; at each position the log-prob of the segment's
token must agree within ``serve.tolerance``, and the top token must be the same wherever moeflow's top two are
further apart than that. Before either, the export's tensors (names and shapes) must be the base model folder's:
a dropped MTP tensor or a renamed router changes no log-prob of the main model, but a serving engine reads those
names. A check that fails raises, naming what differs; nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeflow.data.shards import iter_rows
from moeflow.data.valset import open_valset
from moeflow.model.safetensors_files import read_header, weight_files
from moeflow.runtime.files import read_json
from moeflow.runtime.host_copies import model_device

log = logging.getLogger(__name__)

ENGINE_SCRIPT = Path(__file__).with_name("engine.py")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Families vLLM's CPU build cannot run as published, and why; on a GPU it runs them.
CPU_UNSUPPORTED = {
    "deepseek_v3": "vLLM's CPU MLA kernels take bf16 weights only and lose rotary positions (the output equals every "
    "position at 0); the check runs on a GPU",
    "gpt_oss": "vLLM's CPU build has no unquantized MoE backend for it ('No Unquantized MoE backend supports the "
    "deployment configuration'); the check runs on a GPU",
    "step3p5": "vLLM 0.32's Step-3.5 model reads num_attention_heads as one value, which transformers 5.19's per-layer "
    "config refuses (AmbiguousGlobalPerLayerAttributeError)",
}


class ServeCheckError(RuntimeError):
    """The export does not serve as trained, or the engine could not load it; the message says what differs."""


def model_type(folder: str | os.PathLike) -> str:
    """The ``model_type`` of a model folder's config.json (what the engine picks its implementation by)."""
    return read_json(Path(folder) / "config.json")["model_type"]


def unsupported_reason(model_type: str, engine_device: str) -> str | None:
    """Why the engine cannot check a model of ``model_type`` on ``engine_device`` (None: it can)."""
    return CPU_UNSUPPORTED.get(model_type) if engine_device == "cpu" else None


def valset_segments(valset_dir: str | os.PathLike, max_sequences: int | None = None) -> list[list[int]]:
    """The coverage validation set's segments as the model reads them (each packed document piece from its position
    0; padding dropped; pieces of one token have nothing to predict), in order; the first ``max_sequences``."""
    segments = []
    for row in iter_rows(open_valset(valset_dir)):
        ids, positions, labels = row["input_ids"], row["position_ids"], row["labels"]
        starts = np.flatnonzero(positions == 0).tolist() + [len(ids)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            if hi - lo > 1 and (labels[lo + 1 : hi] >= 0).any():
                segments.append(ids[lo:hi].tolist())
                if max_sequences is not None and len(segments) == max_sequences:
                    return segments
    return segments


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> list[dict[str, list]]:
    """Per sequence, at each position after the first: the log-prob ``model`` gives the sequence's token, its top
    token, and how far its top token is above the second (``margin``: a tie's top token is either)."""
    device = model_device(model)
    out = []
    for ids in sequences:
        logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        top2 = logprobs.topk(2, dim=-1)
        token = logprobs.gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
        out.append(
            {
                "token": token.tolist(),
                "top": top2.indices[:, 0].tolist(),
                "margin": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
            }
        )
    return out


def engine_logprobs(
    python: str | os.PathLike,
    model_dir: str | os.PathLike,
    sequences: Sequence[Sequence[int]],
    dtype: str,
    timeout_s: float,
    threads: int = 1,
) -> dict[str, Any]:
    """The engine's record (moeflow.serving.engine) for ``sequences`` on the folder ``model_dir``, from the serving
    environment's ``python``; a ServeCheckError with the end of its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="moeflow-serve-") as tmp:
        given = Path(tmp) / "sequences.json"
        given.write_text(json.dumps([list(map(int, ids)) for ids in sequences]))
        return run_engine(python, model_dir, ["--sequences", str(given), "--dtype", dtype], timeout_s, threads)


def engine_read_adapter(
    python: str | os.PathLike, model_dir: str | os.PathLike, adapter_dir: str | os.PathLike, timeout_s: float
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """How vLLM's adapter loader reads the adapter at ``adapter_dir`` for the model at ``model_dir`` (no model is
    loaded): the engine's record and the factors it holds (moeflow.serving.engine's ``--adapter``)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="moeflow-serve-") as tmp:
        read = Path(tmp) / "read.safetensors"
        record = run_engine(python, model_dir, ["--adapter", str(adapter_dir), "--read", str(read)], timeout_s)
        return record, load_file(str(read))


def run_engine(
    python: str | os.PathLike, model_dir: str | os.PathLike, args: Sequence[str], timeout_s: float, threads: int = 1
) -> dict[str, Any]:
    """moeflow.serving.engine run by the serving environment's ``python`` on ``model_dir`` with ``args``: its JSON
    record, or a ServeCheckError with the end of its output."""
    python = Path(python)
    if not python.is_file():
        raise ServeCheckError(
            f"config key 'serve.python': {python} does not exist: make the serving environment with `make serve-env` "
            "(it writes .venvs/serve), or point the key at a Python with vLLM installed"
        )
    with tempfile.TemporaryDirectory(prefix="moeflow-serve-") as tmp:
        result = Path(tmp) / "engine.json"
        command = [str(python), str(ENGINE_SCRIPT), "--model", str(model_dir), "--output", str(result), *args]
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": ""}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise ServeCheckError(
                f"the engine took longer than serve.timeout_s ({timeout_s} s) on {model_dir}"
            ) from None
        log.info("engine output:\n%s", done.stdout[-4000:] + done.stderr[-8000:])
        if done.returncode != 0:
            raise ServeCheckError(
                f"vLLM could not serve {model_dir} (exit {done.returncode}); the end of its output:\n"
                + _last_lines(done.stdout + done.stderr)
            )
        return json.loads(result.read_text())


def _last_lines(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def compare(
    reference: Sequence[dict[str, list]], engine: Sequence[dict[str, list]], tolerance: float
) -> dict[str, Any]:
    """How the engine's log-probs (``engine``, moeflow.serving.engine's sequences) agree with moeflow's
    (``reference``, :func:`model_logprobs`): the largest and mean absolute difference of the sequence's token's
    log-prob, and the share of positions with the same top token among those whose top two moeflow sets further
    apart than ``tolerance``; ``passed`` when the largest difference is within ``tolerance`` and every such top token
    agrees. ``worst``: where the largest difference is (sequence, position)."""
    if len(reference) != len(engine):
        raise ServeCheckError(f"the engine scored {len(engine)} sequences, moeflow {len(reference)}")
    diffs, agree, decided, worst = [], 0, 0, (0, 0, 0.0)
    for i, (ref, eng) in enumerate(zip(reference, engine)):
        diff = np.abs(np.asarray(ref["token"], dtype=np.float64) - np.asarray(eng["token"], dtype=np.float64))
        if diff.size and diff.max() > worst[2]:
            worst = (i, int(diff.argmax()) + 1, float(diff.max()))
        diffs.append(diff)
        clear = np.asarray(ref["margin"]) > tolerance
        decided += int(clear.sum())
        agree += int((np.asarray(ref["top"])[clear] == np.asarray(eng["top"])[clear]).sum())
    every = np.concatenate(diffs) if diffs else np.zeros(0)
    largest = float(every.max()) if every.size else 0.0
    return {
        "positions": int(every.size),
        "max_abs_logprob_diff": largest,
        "mean_abs_logprob_diff": float(every.mean()) if every.size else 0.0,
        "worst": {"sequence": worst[0], "position": worst[1]},
        "top_token_positions": decided,
        "top_token_agreement": agree / decided if decided else 1.0,
        "tolerance": tolerance,
        "passed": largest <= tolerance and agree == decided,
    }


def tensor_differences(export_dir: str | os.PathLike, base_dir: str | os.PathLike) -> dict[str, list[str]]:
    """The export's tensors against its base model folder's, by name and shape (the dtype may differ: a base kept
    in bf16 is exported in the training precision): ``missing`` from the export, ``unexpected`` in it, and
    ``reshaped`` (name: base shape -> export shape). Empty lists: the same names and shapes."""
    export, base = _tensor_shapes(export_dir), _tensor_shapes(base_dir)
    return {
        "missing": sorted(set(base) - set(export)),
        "unexpected": sorted(set(export) - set(base)),
        "reshaped": [f"{n}: {base[n]} -> {export[n]}" for n in sorted(set(base) & set(export)) if base[n] != export[n]],
    }


def _tensor_shapes(folder: str | os.PathLike) -> dict[str, list[int]]:
    files = weight_files(folder)
    headers = {path: read_header(path)[0] for path in set(files.values())}
    return {name: list(headers[path][name].shape) for name, path in files.items()}


def refuse_tensor_differences(differences: dict[str, list[str]], export_dir: str | os.PathLike) -> None:
    """A ServeCheckError naming the first tensors of each kind of difference (:func:`tensor_differences`), if any."""
    found = {kind: names for kind, names in differences.items() if names}
    if found:
        listed = "; ".join(f"{kind} {len(names)}: {', '.join(names[:5])}" for kind, names in found.items())
        raise ServeCheckError(
            f"{export_dir}: the export's tensors are not its base model's ({listed}); a serving engine reads the "
            "base model's names and shapes"
        )
