"""The tokenizer: train a byte-level BPE (or load a model's) and encode text and chat documents.

Text is encoded with EOS; chat is rendered with its template and labelled on the assistant turns."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.data.corpus import CorpusError, Document, FileSource, SourceReader, StdlibSource, split_documents
from moeflow.data.shards import IGNORE_INDEX
from moeflow.runtime.files import atomic_dir, write_json
from moeflow.runtime.stage import kill_point, progress
from moeflow.settings import plain

# Special tokens of a tokenizer trained here; ChatML turn markers so chat data has a template.
BOS, EOS, PAD = "<|startoftext|>", "<|endoftext|>", "<|pad|>"


IM_START, IM_END = "<|im_start|>", "<|im_end|>"


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerSettings:
    """The config's ``tokenizer`` section: the size of the BPE vocabulary and how often a pair must occur to merge."""

    vocab_size: int
    min_frequency: int


@dataclass(frozen=True)
class TrainTokenizerStage:
    """Rule train_tokenizer (moeflow.workflow.keys.tokenizer_settings): the tokenizer's settings and the sources,
    split and bad-record rule of the text it is trained on. The data stage's shards depend on all of it too."""

    tokenizer: TokenizerSettings
    pretrained_model: str | None
    sources: Mapping[str, Any]
    split: Mapping[str, Any]
    on_bad_record: str


def set_tokenizer_threads(threads: int) -> None:
    """Let the Rust tokenizer use ``threads`` cores (read once, before its first parallel batch)."""
    os.environ["RAYON_NUM_THREADS"] = str(max(1, int(threads)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def training_texts(settings: TrainTokenizerStage) -> Iterator[str]:
    """The texts a tokenizer is trained on: the TRAIN split of every source (sorted by name).

    Chat documents contribute each message's content (the template's markers are special tokens).
    """
    for name in sorted(settings.sources):
        reader = SourceReader(name, settings.sources[name], settings.on_bad_record)
        for split, _, doc in split_documents(reader, settings.split):
            if split != "train":
                continue
            if doc.messages is not None:
                yield from (m["content"] for m in doc.messages)
            else:
                yield doc.text


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Byte-level BPE trained with the ``tokenizers`` library, wrapped as a PreTrainedTokenizerFast
    (BOS/EOS/PAD and ChatML turn markers as special tokens, a ChatML chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, BOS, PAD, IM_START, IM_END]
    if vocab_size < 256 + len(specials):
        raise CorpusError(
            f"config key 'tokenizer.vocab_size': {vocab_size} is below the 256 bytes + {len(specials)} special tokens"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_fast_tokenizer(path: str | os.PathLike):
    """A tokenizer folder (trained here, or a pretrained model's), offline, without remote code; it must be
    a fast (Rust) one, which the data stage encodes with (``moeflow.model.folder.load_tokenizer`` loads any)."""
    from transformers import AutoTokenizer

    if not Path(path, "tokenizer_config.json").is_file() and not Path(path, "tokenizer.json").is_file():
        raise CorpusError(
            f"{path} is not a tokenizer folder (no tokenizer.json / tokenizer_config.json); "
            "point model.pretrained at a model folder with its tokenizer"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise CorpusError(f"the tokenizer in {path} is not a fast (Rust) tokenizer; save it with tokenizer.json")
    return tokenizer


def folder_hash(path: str | os.PathLike) -> str:
    """SHA-256 over a folder's file names and bytes (sorted): identifies a tokenizer."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


class DocumentEncoder:
    """Documents to ``(token_ids, labels or None)`` in batches with the Rust tokenizer.

    Text documents get EOS appended and predict every token. Chat documents are rendered with the
    tokenizer's chat template; with ``assistant_only_labels`` (default) only assistant turns
    (without the turn header) have labels.
    """

    def __init__(self, tokenizer: Any, source: StdlibSource | FileSource):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.assistant_only = isinstance(source, FileSource) and source.assistant_only_labels  # stdlib has no chat

    def encode(self, docs: Sequence[Document]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        out: list[tuple[np.ndarray, np.ndarray | None] | None] = [None] * len(docs)
        text_index = [i for i, d in enumerate(docs) if d.messages is None]
        encodings = self.backend.encode_batch_fast([docs[i].text for i in text_index], add_special_tokens=False)
        eos = [] if self.eos_id is None else [self.eos_id]
        for i, enc in zip(text_index, encodings):
            out[i] = (np.array(enc.ids + eos, dtype=np.int32), None)
        for i, doc in enumerate(docs):
            if doc.messages is not None:
                out[i] = self.encode_chat(doc)
        return out

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool, origin: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja2 and transformers raise several types for a bad template/record
            raise CorpusError(
                f"{origin}: the tokenizer's chat template failed on this conversation "
                f"({exc}); fix the record or the template"
            ) from None

    def encode_chat(self, doc: Document) -> tuple[np.ndarray, np.ndarray]:
        """Render a conversation and label the assistant turns (character spans mapped to tokens)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise CorpusError(
                f"{doc.origin}: chat data needs a tokenizer with a chat_template; this tokenizer has none"
            )
        messages = list(doc.messages)
        text = self._render(messages, False, doc.origin)
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = np.array(enc.ids, dtype=np.int32)
        if not self.assistant_only:
            return ids, ids.copy()
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:k], True, doc.origin) if k else ""
            upto = self._render(messages[: k + 1], False, doc.origin)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise CorpusError(
                    f"{doc.origin}: the chat template does not render conversations prefix by prefix, so assistant "
                    f"turns cannot be located; set assistant_only_labels: false for this source"
                )
            spans.append((len(before), len(upto)))
        starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(ids))
        keep = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            keep |= (starts >= lo) & (starts < hi)
        return ids, np.where(keep, ids, IGNORE_INDEX).astype(np.int32)


def train_tokenizer_stage(
    settings: TrainTokenizerStage,
    out_dir: str | os.PathLike,
    threads: int = 1,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the tokenizer of a model built from config and save it (atomically) as a tokenizer folder,
    with ``moeflow_tokenizer.json`` saying what it was trained on."""
    set_tokenizer_threads(threads)
    counter = {"texts": 0, "chars": 0}

    def counted(texts: Iterable[str]) -> Iterator[str]:
        for text in progress(texts, desc="train tokenizer (texts)"):
            counter["texts"] += 1
            counter["chars"] += len(text)
            yield text

    tokenizer = train_tokenizer(
        counted(training_texts(settings)), settings.tokenizer.vocab_size, settings.tokenizer.min_frequency
    )
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(str(tmp))
        info = {
            "trained_on": counter,
            "vocab_size": len(tokenizer),
            "settings": plain(settings),
            "provenance": dict(provenance or {}),
        }
        write_json(tmp / "moeflow_tokenizer.json", info)
        kill_point("train_tokenizer.before_rename")
    return info
