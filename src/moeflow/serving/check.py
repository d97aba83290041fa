"""Whether a run's exported model serves as it was trained: a serving engine's log-probs against moeflow's.

Rule serve_check loads the exported folder twice: with moeflow's own loader (the model the run trained and evaluated)
and in vLLM, started in the serving environment's Python (moeflow.serving.engine). Both score every segment of the
coverage validation set, so every expert serves some of its tokens; at each position the log-prob of the segment's
token must agree within ``serve.tolerance``, and the top token must be the same wherever moeflow's top two are
further apart than twice that. Before either, the export's tensors (names and shapes) must be the base model folder's:
a dropped MTP tensor or a renamed router changes no log-prob of the main model, but a serving engine reads those
names. A check that fails raises, naming what differs; nothing is written.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeflow.data.shards import iter_rows
from moeflow.data.valset import open_valset
from moeflow.loading.factory import make_model
from moeflow.model.device import compute_device
from moeflow.model.safetensors_files import read_header, weight_files
from moeflow.runtime.files import read_json
from moeflow.runtime.host_copies import model_device
from moeflow.serving.process import ServeCheckError, run_engine
from moeflow.serving.settings import ServeCheckStage, unsupported_reason

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def valset_segments(
    valset_dir: str | os.PathLike, max_sequences: int | None = None, max_tokens: int | None = None
) -> list[list[int]]:
    """The coverage validation set's segments as the model reads them (each packed document piece from its position
    0; padding dropped; pieces of one token have nothing to predict), in order; the first ``max_sequences``, each
    cut to ``max_tokens``."""
    segments = []
    for row in iter_rows(open_valset(valset_dir)):
        ids, positions, labels = row["input_ids"], row["position_ids"], row["labels"]
        starts = np.flatnonzero(positions == 0).tolist() + [len(ids)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            if max_tokens is not None:
                hi = min(hi, lo + max_tokens)
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
    environment's ``python``; an EngineError with the end of its output when it fails."""
    given = [list(map(int, ids)) for ids in sequences]
    return run_engine(python, model_dir, ["--dtype", dtype], timeout_s, threads, request=("--sequences", given))


def compare(
    reference: Sequence[dict[str, list]], engine: Sequence[dict[str, list]], tolerance: float
) -> dict[str, Any]:
    """How the engine's log-probs (``engine``, moeflow.serving.engine's sequences) agree with moeflow's
    (``reference``, :func:`model_logprobs`): the largest and mean absolute difference of the sequence's token's
    log-prob, and the share of positions with the same top token among those whose top two moeflow sets further
    apart than twice ``tolerance``; ``passed`` when the largest difference is within ``tolerance`` and every such top
    token agrees. ``worst``: where the largest difference is (sequence, position)."""
    if len(reference) != len(engine):
        raise ServeCheckError(f"the engine scored {len(engine)} sequences, moeflow {len(reference)}")
    diffs, agree, decided, worst = [], 0, 0, (0, 0, 0.0)
    for i, (ref, eng) in enumerate(zip(reference, engine)):
        if len(ref["token"]) != len(eng["token"]):
            raise ServeCheckError(
                f"sequence {i}: the engine scored {len(eng['token'])} positions, moeflow {len(ref['token'])}"
            )
        diff = np.abs(np.asarray(ref["token"], dtype=np.float64) - np.asarray(eng["token"], dtype=np.float64))
        diff = np.nan_to_num(diff, nan=np.inf)  # a NaN on either side is a difference, and the worst one
        if diff.size and diff.max() > worst[2]:
            worst = (i, int(diff.argmax()) + 1, float(diff.max()))
        diffs.append(diff)
        # each side's log-probs may move by the tolerance: a flip between two tokens closer than twice it is allowed
        clear = np.asarray(ref["margin"]) > 2 * tolerance
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


def check_export(
    settings: ServeCheckStage,
    model_dir: str | os.PathLike,
    base_dir: str | os.PathLike,
    experts: str | os.PathLike,
    valset_dir: str | os.PathLike,
    threads: int = 1,
) -> dict[str, Any]:
    """The serving check of one run's export at ``model_dir`` (module docstring): its record, or a ServeCheckError
    saying what differs. ``base_dir``: its base model folder; ``experts``: the run's experts choice."""
    serve = settings.serve
    config = read_json(Path(model_dir) / "config.json")  # its model_type is what the engine picks its code by
    record = {"run": settings.run, "model_type": config["model_type"], "dtype": serve.dtype}
    refuse_tensor_differences(tensor_differences(model_dir, base_dir), model_dir)
    reason = unsupported_reason(record["model_type"], settings.device)
    if reason:
        log.warning("serve_check: %s is not checked on %s: %s", record["model_type"], settings.device, reason)
        return record | {"checked": False, "reason": reason}
    # vLLM generates one token after each sequence: the longest must stay under the model's positions
    limit = config.get("max_position_embeddings")
    sequences = valset_segments(valset_dir, serve.max_sequences, limit - 1 if limit else None)
    device = compute_device(settings.device)
    model = make_model(settings.model, experts=experts, folder=model_dir, device=device, dtype=DTYPES[serve.dtype])
    reference = model_logprobs(model.eval(), sequences)
    del model  # the engine loads the model next, in its own process, and measures the device's free memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = engine_logprobs(serve.python, model_dir, sequences, serve.dtype, serve.timeout_s, threads)
    agreement = compare(reference, engine["sequences"], serve.tolerance)
    record |= {"checked": True, "engine": engine["engine"], "engine_version": engine["version"]}
    record |= {"engine_device": engine["device"], "sequences": len(sequences), **agreement}
    log.info("serve_check: %s", {k: v for k, v in record.items() if k != "worst"})
    if not agreement["passed"]:
        raise ServeCheckError(
            f"run {settings.run!r}: {record['engine']} {record['engine_version']} does not compute what moeflow "
            f"computes from {model_dir} in {serve.dtype}: largest |log-prob difference| "
            f"{agreement['max_abs_logprob_diff']:.3g} (serve.tolerance {serve.tolerance:g}) at sequence "
            f"{agreement['worst']['sequence']} position {agreement['worst']['position']}, top token agreeing at "
            f"{agreement['top_token_agreement']:.1%} of {agreement['top_token_positions']} positions. Do not serve "
            "this export with this engine: compare the family's config with the engine's implementation (a feature "
            "one side ignores), or, in a lower precision than float32, measure a tolerance for it"
        )
    return record
