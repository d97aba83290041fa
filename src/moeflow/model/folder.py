"""A pretrained model folder: checked before loading, its tokenizer, the vocabulary check.

Before loading, the folder must hold safetensors only, and its remote code is refused unless allowed; the
vocabulary is checked against tokenized data.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from moeflow.runtime.files import read_json


class ModelError(ValueError):
    """A model that cannot be built or loaded, with what to do about it."""


# Weight files that are Python pickles: loading one can run arbitrary code, so moeflow never does.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def check_model_folder(path: str | os.PathLike) -> Path:
    """A folder made by ``save_pretrained`` with safetensors weights, or a ModelError saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelError(
            f"model folder {path} does not exist: point 'model.pretrained' at a local folder made by save_pretrained"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model folder {path} has no config.json: point 'model.pretrained' at a folder made by save_pretrained"
        )
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
        found = (
            f"it holds pickle weights ({', '.join(pickles)}), which "
            if pickles
            else "it has no weights; pickle weights "
        )
        raise ModelError(
            f"model folder {path} has no safetensors weights: {found}moeflow refuses to load because unpickling can "
            "run code. Convert the model to safetensors (save_pretrained(..., safe_serialization=True)) "
            "from a source you trust"
        )
    return path


@contextlib.contextmanager
def refusing_remote_code(path: Path) -> Iterator[None]:
    """transformers' refusal of a folder's own code (``trust_remote_code`` off) as a ModelError saying what to do."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ModelError(
            f"model folder {path} needs custom code from the folder (config.json auto_map) "
            "and model.trust_remote_code is off: moeflow does not run a model's own Python unless the config says "
            "so for that model. If you trust it, set model.trust_remote_code: true next to model.pretrained "
            "(the verification report records it)"
        ) from None


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ModelError(
            f"tokenizer folder {path} does not exist: "
            "it is the model folder ('model.pretrained') or one the pipeline trained"
        )
    with refusing_remote_code(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def check_vocabulary(
    model: Any, data_dirs: Sequence[str | os.PathLike], model_path: str | os.PathLike = "the model"
) -> None:
    """Refuse data tokenized with a tokenizer that has more tokens than the model has embedding rows
    (a model may have more rows than tokens: vocabularies are often padded)."""
    rows = model.get_input_embeddings().num_embeddings
    for folder in data_dirs:
        manifest = Path(folder) / "manifest.json"
        tokenizer = (read_json(manifest).get("tokenizer") or {}) if manifest.is_file() else {}
        size = tokenizer.get("vocab_size")
        if size is not None and int(size) > rows:
            raise ModelError(
                f"tokenizer/model mismatch: {folder} was tokenized with a tokenizer of {size} tokens, but {model_path} "
                f"has {rows} embedding rows. Use the model's own tokenizer (model.pretrained brings it) or a model "
                "whose vocabulary covers the tokenizer"
            )
