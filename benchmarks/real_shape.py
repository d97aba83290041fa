"""The model and rows of benchmarks/train.py's real-shape runs (``--shape``): a published MoE's router and
vocabulary on a decoder small enough to train on this CPU, and synthetic packed rows over that vocabulary.

At such a vocabulary the output layer and the loss, not the decoder, set a step's memory and much of its
time, which the embedded default's 4,096 entries hide. The rows are synthetic (no tokenizer or corpus is
downloaded) but shaped like a corpus's: token ids drawn from a Zipf law over the whole vocabulary
(exponent 1.1, ranks shuffled over the ids), log-normal document lengths (median 300 tokens, so ~3
documents a row and some spanning rows), each ending in an end-of-text id, packed by moeflow.data.packing as
the data stage packs (positions restart per document, the first token of each segment unlabelled).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeflow.data.packing import pack_documents
from moeflow.workflow.load import load, read_yaml

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RealShape:
    config_file: Path  # the published model's config (config/models/), whose router and vocabulary are kept
    decoder: dict  # its model.config keys replaced to make the decoder small
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def vocab_size(self) -> int:
        return int(read_yaml(self.config_file)["model"]["config"]["vocab_size"])


SHAPES = {
    # Qwen3-30B-A3B's 128 experts, top-8, normalised top-k and 151,936 entries; hidden 2048 -> 256 with the
    # published proportions (head_dim 128 -> 64, expert width 768/2048 of hidden), 48 -> 4 layers.
    "qwen3-30b-a3b-router": RealShape(
        config_file=REPO / "config" / "models" / "qwen3-30b-a3b.yaml",
        decoder={
            "hidden_size": 256,
            "intermediate_size": 768,
            "moe_intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 4096,
        },
        seq_len=2048,
        micro_batch_size=2,
        grad_accum_steps=4,
    ),
}

ZIPF_EXPONENT = 1.1
DOCUMENT_MEDIAN_TOKENS, DOCUMENT_SIGMA, DOCUMENT_MAX_TOKENS = 300, 1.2, 16384


def model_section(shape: RealShape, vocab_size: int) -> dict:
    """The ``model`` section of ``shape`` at ``vocab_size`` entries, fp32 loss chunks as configured. The experts
    run eager on both stacks: what ``experts_implementation: auto`` measures as fastest on this CPU."""
    overrides = {"config": {**shape.decoder, "vocab_size": int(vocab_size)}, "experts_implementation": "eager"}
    return load(shape.config_file, overrides={"model": overrides})["model"]


def synthetic_rows(shape: RealShape, vocab_size: int, rows: int, seed: int = 0) -> list[dict]:
    """``rows`` full packed rows of ``shape.seq_len`` tokens over ``vocab_size`` ids (see the module doc); the
    last id is the end-of-text token."""
    rng = np.random.default_rng(seed)
    words = vocab_size - 1
    frequency = 1.0 / np.arange(1, words + 1, dtype=np.float64) ** ZIPF_EXPONENT
    frequency /= frequency.sum()
    ids_by_rank = rng.permutation(words)

    def documents():
        for doc_id in itertools.count():
            length = int(np.clip(rng.lognormal(np.log(DOCUMENT_MEDIAN_TOKENS), DOCUMENT_SIGMA), 2, DOCUMENT_MAX_TOKENS))
            yield doc_id, np.append(ids_by_rank[rng.choice(words, size=length - 1, p=frequency)], words), None

    return list(itertools.islice(pack_documents(documents(), shape.seq_len), rows))
