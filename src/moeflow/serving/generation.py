"""Completions generated in vLLM (``evaluate.humaneval.engine: vllm``), as moeflow's own generation makes them.

The prompts are tokenized and cut to the model's context as moeflow.evaluation.generation does, vLLM generates in
the serving environment's Python (moeflow.serving.engine's ``--generate``: greedy, or sampled with the seed
``seed + i`` for prompt i), and its token ids become completions through the same cut at the stop sequences
(moeflow.evaluation.generation.completion), so the samples file is the same format either way and a greedy
completion is the same text wherever the two engines pick the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeflow.evaluation.completions import Completion
from moeflow.evaluation.generation import Decoding, completion, context_room, prompt_ids
from moeflow.runtime.files import read_json
from moeflow.serving.process import run_engine


def engine_completions(
    python: str | os.PathLike,
    model_dir: str | os.PathLike,
    tokenizer: Any,
    prompts: Sequence[str],
    decoding: Decoding,
    stops: Sequence[str],
    seed: int,
    dtype: str,
    timeout_s: float,
) -> list[Completion]:
    """One completion per prompt from vLLM on the folder ``model_dir`` (``python``: the serving environment's)."""
    limit = read_json(Path(model_dir) / "config.json").get("max_position_embeddings")
    encoded = [prompt_ids(tokenizer, p, context_room(limit, decoding)) for p in prompts]
    requests = {
        "prompts": [ids for ids, _ in encoded],
        "max_tokens": decoding.max_new_tokens,
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        "seeds": [seed + i for i in range(len(prompts))],
        "stop": list(stops),
    }
    record = run_engine(python, model_dir, ["--dtype", dtype], timeout_s, request=("--generate", requests))
    return [
        completion(tokenizer, done["token_ids"], stops, len(ids), truncated)
        for (ids, truncated), done in zip(encoded, record["completions"])
    ]
