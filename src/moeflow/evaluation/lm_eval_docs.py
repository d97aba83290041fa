"""The documents of moeflow's own lm-eval tasks, from an evaluation corpus's packed test split.

The tasks are in workflow/tasks/, and the split's rows are the data stage's (``moeflow.data.shards``). lm-eval's side
of the documents, the dataset loader and the per-document scores the task YAMLs name with ``!function``, is
workflow/tasks/moeflow_tasks.py, which imports nothing of moeflow (the serving environment's lm-eval runs it too).

- ``segments``: one document per packed segment, the token span of one document inside one row that
  moeflow's evaluation scores on its own (attention stays inside it, its first token is context only).
  Its text is the segment decoded; ``labels`` counts the tokens it predicts.
- ``body_choice``: a function of a held-out module (the test split's documents parsed as Python), its
  signature and docstring as the prompt and its real body among the bodies of other functions of the split.

The stage writes the documents as JSONL and hands lm-eval the file through the task's metadata
(:data:`DOCS_FILE`); moeflow_tasks.docs reads it back as the task's test split.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeflow.data.shards import IGNORE_INDEX, PAD_DOC_ID, iter_rows, read_documents

SEGMENTS, BODY_CHOICE = "segments", "body_choice"


DOCS_KINDS = (SEGMENTS, BODY_CHOICE)


DOCS_FILE = "moeflow_docs_file"  # the lm-eval metadata key that names a task's documents


class TaskDataError(ValueError):
    """Documents that cannot be built, with what to do about it."""


@dataclass(frozen=True)
class Segment:
    """One scored span of a packed row: its tokens and their labels (the first is never predicted)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels[1:])

    def row(self) -> dict[str, np.ndarray]:
        """The segment as a packed row of its own (``moeflow.data.shards`` format) for moeflow's evaluation loop."""
        n = len(self.input_ids)
        labels = np.array(self.labels, dtype=np.int32)
        labels[0] = IGNORE_INDEX
        return {
            "input_ids": np.array(self.input_ids, dtype=np.int32),
            "labels": labels,
            "position_ids": np.arange(n, dtype=np.int32),
            "doc_ids": np.zeros(n, dtype=np.int64),
        }


def segments(rows: Any) -> list[Segment]:
    """The segments of packed rows in order (a new one wherever the position restarts at 0), padding dropped.
    A one-token segment predicts nothing and is left out."""
    out = []
    for row in iter_rows(rows):
        positions = np.asarray(row["position_ids"])
        starts = np.flatnonzero(positions == 0).tolist() + [len(positions)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            if int(row["doc_ids"][lo]) == PAD_DOC_ID or hi - lo < 2:
                continue
            out.append(
                Segment(tuple(int(t) for t in row["input_ids"][lo:hi]), tuple(int(t) for t in row["labels"][lo:hi]))
            )
    return out


def segment_docs(parts: Sequence[Segment], tokenizer: Any) -> list[dict[str, Any]]:
    """The ``segments`` task's documents: each segment's text, and its tokens (``input_ids``) as the data stage
    made them, which lm-eval is given instead of encoding the text again (a segment cut inside a run of
    spaces, say, encodes back to other tokens; see moeflow.evaluation.lm_eval_run.evaluate_task)."""
    return [
        {
            "text": decode(tokenizer, part.input_ids),
            "input_ids": list(part.input_ids),
            "labels": part.label_tokens,
            "tokens": len(part.input_ids),
        }
        for part in parts
    ]


def decode(tokenizer: Any, ids: Iterable[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Function:
    """A function of a module: its signature and docstring (the prompt), and the rest (its body), dedented."""

    prompt: str
    body: str


def document_texts(rows: Any, tokenizer: Any) -> list[str]:
    """The split's documents, reassembled across rows and decoded (the EOS the data stage appends dropped)."""
    eos = tokenizer.eos_token_id
    texts = []
    for _, ids in read_documents(rows):
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        texts.append(decode(tokenizer, ids))
    return texts


def functions(source: str) -> list[Function]:
    """Functions and methods with a docstring and a body after it, in source order; [] for text that is
    not Python."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None:
            continue
        indent = node.col_offset
        docstring_end = node.body[0].end_lineno
        prompt = _dedent(lines[node.lineno - 1 : docstring_end], indent)
        body = _dedent(lines[docstring_end : node.end_lineno], indent)
        if body.strip():
            out.append(Function(prompt, body))
    return out


def _dedent(lines: Sequence[str], indent: int) -> str:
    """Lines moved left by the def's indentation (blank lines keep their newline; a line indented less, inside a
    string, loses its indentation)."""
    return "".join(
        line.lstrip(" \t") if not line.strip() else line[indent:] if not line[:indent].strip() else line.lstrip()
        for line in lines
    )


def body_choice_docs(
    texts: Iterable[str], tokenizer: Any, *, choices: int, seed: int, max_tokens: int
) -> list[dict[str, Any]]:
    """One item per function whose prompt and body fit in ``max_tokens``: the real body and ``choices - 1``
    other bodies of the split that fit with its prompt, drawn (and the answer placed) by a generator seeded
    with ``seed``, in source order, so the same split and seed give the same items."""
    found = [f for text in texts for f in functions(text)]
    length = {s: len(tokenizer.encode(s, add_special_tokens=False)) for f in found for s in (f.prompt, f.body)}
    bodies = sorted({f.body for f in found}, key=lambda b: (length[b], b))
    rng = random.Random(seed)
    docs = []
    for f in found:
        room = max_tokens - length[f.prompt]
        others = [b for b in bodies if b != f.body and length[b] <= room]
        if length[f.body] > room or len(others) < choices - 1:
            continue
        options = rng.sample(others, choices - 1)
        gold = rng.randrange(choices)
        options.insert(gold, f.body)
        docs.append({"prompt": f.prompt, "choices": options, "gold": gold})
    return docs


def write_docs(path: Any, docs: Iterable[Mapping[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
