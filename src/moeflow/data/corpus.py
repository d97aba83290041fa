"""Read the corpora named in ``data.sources``, and split their documents by content hash.

A source (``data.sources.<name>``) has a ``type``:

- ``stdlib``: the running interpreter's standard library, one document per ``.py`` file (tests,
  idlelib, turtledemo and site-packages left out), filtered by top-level package with ``packages``
  and ``exclude_packages``. The manifest records the Python version and every file's hash.
- ``jsonl``: one record per line; the text is ``text_field`` (default ``text``), or a chat
  conversation in ``messages_field`` (a list of ``{role, content}``) rendered later with the
  tokenizer's chat template.
- ``parquet``: a column ``text_field`` (or ``messages_field``), read in batches.
- ``text``: plain text files, one document per file.
- ``hf_disk``: a folder written by ``datasets.Dataset.save_to_disk``, same fields as Parquet.

``path`` is a file, a folder (every matching file below it, sorted) or a glob. Bad input (invalid
JSON, bytes that are not UTF-8, a record without the field, an empty file) fails with the file, line
and what to do, or with ``data.on_bad_record: skip`` is skipped and counted. A missing path and a
corpus left empty are always errors.

The Snakefile imports this module at DAG-build time (``source_files``): nothing heavy at top level.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moeflow.settings import BAD_RECORD_POLICIES, SOURCE_SCHEMA, enum, typed

log = logging.getLogger(__name__)


SPLITS = ("train", "heldout", "test")


FILE_EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "text": None}


STDLIB_EXCLUDED_TOP = {"test", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}


STDLIB_EXCLUDED_DIRS = {"test", "tests", "__pycache__"}


MAX_EXAMPLES = 20


STDLIB_ONLY_KEYS = {"packages", "exclude_packages"}


FILE_ONLY_KEYS = {"path", "text_field", "messages_field", "assistant_only_labels"}


class CorpusError(ValueError):
    """Unusable input, with the file, line and what to do about it."""


@dataclass(frozen=True)
class StdlibSource:
    """A ``data.sources`` entry of type stdlib: the running Python's standard library, by top-level package."""

    SCHEMA: ClassVar[str] = SOURCE_SCHEMA
    type: str
    packages: tuple[str, ...] | None
    exclude_packages: tuple[str, ...]


@dataclass(frozen=True)
class FileSource:
    """A ``data.sources`` entry read from files (jsonl, parquet, text, hf_disk)."""

    SCHEMA: ClassVar[str] = SOURCE_SCHEMA
    type: str
    path: str
    text_field: str
    messages_field: str | None
    assistant_only_labels: bool


def source_settings(name: str, source_cfg: Mapping[str, Any]) -> StdlibSource | FileSource:
    """A ``data.sources`` entry, typed by its kind (the keys it leaves out take the defaults of its kind);
    keys of the other kind and a file source without ``path`` are a CorpusError naming the key."""
    kind = source_cfg["type"]
    misplaced = sorted(set(source_cfg) & (FILE_ONLY_KEYS if kind == "stdlib" else STDLIB_ONLY_KEYS))
    if misplaced:
        raise CorpusError(
            f"config key 'data.sources.{name}': {', '.join(misplaced)} do not apply to a source of type {kind}; "
            "remove them"
        )
    if kind != "stdlib" and "path" not in source_cfg:
        raise CorpusError(f"config key 'data.sources.{name}.path' is required for a source of type {kind}")
    return typed(StdlibSource if kind == "stdlib" else FileSource, source_cfg)


@dataclass(frozen=True)
class Document:
    """One document: plain ``text``, or chat ``messages``; ``origin`` says where it came from."""

    origin: str
    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None

    def digest(self) -> bytes:
        """SHA-256 of the content: the document's identity, split and id."""
        if self.messages is not None:
            blob = b"messages\0" + json.dumps(list(self.messages), sort_keys=True, ensure_ascii=False).encode()
        else:
            blob = self.text.encode("utf-8")
        return hashlib.sha256(blob).digest()


def doc_id_of(digest: bytes) -> int:
    """A stable non-negative int64 id: the first 8 bytes of the content hash, top bit cleared."""
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def split_of(digest: bytes, fractions: Mapping[str, float]) -> str:
    """train / heldout / test from the content hash alone: adding or removing other documents never
    moves a document, and a document is in exactly one split."""
    u = int.from_bytes(digest[8:16], "big") / 2.0**64
    if u < fractions["test"]:
        return "test"
    if u < fractions["test"] + fractions["heldout"]:
        return "heldout"
    return "train"


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _expand(kind: str, path: str) -> list[str]:
    """The existing files a file-based source reads, sorted; [] when nothing matches."""
    path = str(path)
    if kind == "hf_disk":
        root = Path(path)
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    if _has_glob(path):
        found = glob.glob(path, recursive=True)
    elif os.path.isdir(path):
        found = [str(p) for p in Path(path).rglob("*")]
        suffixes = FILE_EXTENSIONS[kind]
        if suffixes:
            found = [f for f in found if f.endswith(suffixes)]
    else:
        found = [path] if os.path.exists(path) else []
    return sorted(f for f in found if os.path.isfile(f))


def source_files(source_cfg: Mapping[str, Any]) -> list[str]:
    """The files a source reads, for the Snakefile's ``input:`` (editing one reruns tokenization).

    ``[]`` for ``stdlib`` (its files and the Python version are recorded in the manifest instead) and
    for a path that matches nothing (the stage then fails with a message saying what to do).
    """
    if source_cfg["type"] == "stdlib":
        return []
    return _expand(source_cfg["type"], source_cfg["path"])


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_top_level(rel: Path) -> str:
    """The top-level module or package name of a file below the stdlib root."""
    return rel.parts[0][:-3] if len(rel.parts) == 1 else rel.parts[0]


def stdlib_files(packages: list[str] | None = None, exclude_packages: list[str] | None = None) -> list[Path]:
    """Standard-library ``.py`` files (relative paths, sorted), without tests, idlelib, turtledemo."""
    root = stdlib_root()
    include = set(packages) if packages else None
    exclude = set(exclude_packages or ())

    def wanted(top: str) -> bool:
        return top not in STDLIB_EXCLUDED_TOP and top not in exclude and (include is None or top in include)

    out = []
    for folder, dirs, names in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        # prune whole subtrees: site-packages alone can be far larger than the standard library
        dirs[:] = [d for d in dirs if d not in STDLIB_EXCLUDED_DIRS and (rel_folder != Path(".") or wanted(d))]
        out += [rel_folder / n for n in names if n.endswith(".py") and wanted(stdlib_top_level(rel_folder / n))]
    return sorted(out, key=lambda p: p.as_posix())


class BadRecords:
    """The ``data.on_bad_record`` policy: raise (``fail``) or count and go on (``skip``)."""

    def __init__(self, policy: str, source: str):
        if policy not in enum(BAD_RECORD_POLICIES):
            raise CorpusError(
                f"config key 'data.on_bad_record': {policy!r} must be one of {', '.join(enum(BAD_RECORD_POLICIES))}"
            )
        self.policy = policy
        self.source = source
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []

    def __call__(self, kind: str, where: str, problem: str, fix: str) -> None:
        message = (
            f"{where}: {problem} (corpus '{self.source}'). {fix}, "
            "or set data.on_bad_record: skip to skip and count such records"
        )
        if self.policy == "fail":
            raise CorpusError(message)
        self.counts[kind] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {problem}")
        log.warning("skipped: %s: %s", where, problem)


def _decode(data: bytes, where: str, bad: BadRecords, line: int | None = None) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if line is None:
            line = data[: exc.start].count(b"\n") + 1
        at = f"{where}:{line}"
        bad(
            "not_utf8",
            at,
            f"bytes that are not UTF-8 ({exc.reason} at byte {exc.start})",
            "Re-encode the file as UTF-8",
        )
        return None


class SourceReader:
    """Iterate the documents of one named source; fingerprint its files and count what was skipped."""

    def __init__(self, name: str, source_cfg: Mapping[str, Any], on_bad_record: str = "fail"):
        self.name = name
        self.source = source_settings(name, source_cfg)
        self.kind = self.source.type
        file_based = isinstance(self.source, FileSource)
        self.text_field = self.source.text_field if file_based else None
        self.messages_field = self.source.messages_field if file_based else None
        self.bad = BadRecords(on_bad_record, name)
        self.file_hashes: dict[str, str] = {}
        self.documents_read = 0
        self.empty_documents = 0
        self.duplicate_documents = 0

    # ----------------------------------------------------------------- public

    def documents(self) -> Iterator[Document]:
        """Every non-empty document, in a fixed order (files sorted, records in file order)."""
        reader = {
            "stdlib": self._stdlib,
            "jsonl": self._jsonl,
            "parquet": self._parquet,
            "text": self._text,
            "hf_disk": self._hf_disk,
        }[self.kind]
        for doc in reader():
            if doc.text is not None and not doc.text.strip():
                self.empty_documents += 1
                continue
            self.documents_read += 1
            yield doc

    def files(self) -> list[str]:
        if self.kind == "stdlib":
            return []
        path = self.source.path
        files = _expand(self.kind, path)
        if not files:
            what = "no file matches" if _has_glob(path) else "does not exist or holds no matching files"
            raise CorpusError(
                f"config key 'data.sources.{self.name}.path': {path} {what} "
                f"(working directory {os.getcwd()}); fix the path"
            )
        return files

    def describe(self) -> str:
        values = {k: getattr(self.source, k, None) for k in ("path", "packages", "exclude_packages")}
        filters = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v}
        skipped = sum(self.bad.counts.values())
        return (
            f"type {self.kind}, {', '.join(f'{k}={v}' for k, v in filters.items()) or 'no filters'}; "
            f"{self.empty_documents} empty documents, {skipped} skipped records"
        )

    def fingerprint(self) -> dict[str, Any]:
        """What the documents were read from: file hashes (and the Python version for stdlib)."""
        out: dict[str, Any] = {"type": self.kind, "files": dict(sorted(self.file_hashes.items()))}
        if self.kind == "stdlib":
            out["python"] = platform.python_version()
            out["implementation"] = sys.implementation.name
            out["packages"] = sorted(self.source.packages or [])
            out["exclude_packages"] = sorted(self.source.exclude_packages)
        return out

    def skipped(self) -> dict[str, Any]:
        return {
            "counts": dict(sorted(self.bad.counts.items())),
            "total": sum(self.bad.counts.values()),
            "examples": self.bad.examples,
        }

    # ----------------------------------------------------------------- readers

    def _read_bytes(self, path: str | Path, key: str) -> bytes:
        data = Path(path).read_bytes()
        self.file_hashes[key] = hashlib.sha256(data).hexdigest()
        return data

    def _hash_file(self, path: str) -> None:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        self.file_hashes[path] = digest.hexdigest()

    def _stdlib(self) -> Iterator[Document]:
        root = stdlib_root()
        packages, exclude = self.source.packages, self.source.exclude_packages
        files = stdlib_files(packages, exclude)
        if packages:
            present = {stdlib_top_level(f) for f in stdlib_files(packages)}
            missing = sorted(set(packages) - present)
            if missing:
                raise CorpusError(
                    f"config key 'data.sources.{self.name}.packages': {', '.join(missing)} not found in the "
                    f"standard library of Python {platform.python_version()} ({root}); remove them"
                )
        for rel in files:
            key = rel.as_posix()
            text = _decode(self._read_bytes(root / rel, key), f"{root / rel}", self.bad)
            if text is not None:
                yield Document(origin=key, text=text)

    def _text(self) -> Iterator[Document]:
        for path in self.files():
            data = self._read_bytes(path, path)
            if not data:
                self.bad("empty_file", path, "empty file", "Remove the file or fill it")
                continue
            text = _decode(data, path, self.bad)
            if text is not None:
                yield Document(origin=path, text=text)

    def _jsonl(self) -> Iterator[Document]:
        for path in self.files():
            records = 0
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for number, raw in enumerate(fh, 1):
                    digest.update(raw)
                    if not raw.strip():
                        continue
                    records += 1
                    line = _decode(raw, path, self.bad, number)
                    if line is None:
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        self.bad(
                            "invalid_json",
                            f"{path}:{number}",
                            f"not valid JSON ({exc.msg} at column {exc.colno})",
                            "Fix the line",
                        )
                        continue
                    doc = self._record(record, f"{path}:{number}")
                    if doc is not None:
                        yield doc
            self.file_hashes[path] = digest.hexdigest()
            if records == 0:
                self.bad("empty_file", path, "empty file (no JSON records)", "Remove the file or fill it")

    def _table_batches(self, path: str, batches: Iterator[Any], names: list[str], num_rows: int) -> Iterator[Document]:
        field = self.messages_field or self.text_field
        if num_rows == 0:
            self.bad("empty_file", path, "empty file (no rows)", "Remove it or fill it")
            return
        if field not in names:
            self.bad(
                "missing_field",
                path,
                f"no column '{field}' (columns: {', '.join(names)})",
                f"Set data.sources.{self.name}.{'messages_field' if self.messages_field else 'text_field'}"
                " to the right column",
            )
            return
        row = 0
        for batch in batches:
            for record in batch.column(field).to_pylist():
                row += 1
                doc = self._record({field: record} if record is not None else {}, f"{path}:row {row}")
                if doc is not None:
                    yield doc

    def _parquet(self) -> Iterator[Document]:
        import pyarrow.parquet as pq

        for path in self.files():
            self._hash_file(path)
            try:
                pf = pq.ParquetFile(path)
            except Exception as exc:  # pyarrow raises several types for a broken file
                self.bad("invalid_file", path, f"not a readable Parquet file ({exc})", "Fix or remove the file")
                continue
            names = pf.schema_arrow.names
            field = self.messages_field or self.text_field
            columns = [field] if field in names else None
            yield from self._table_batches(
                path, pf.iter_batches(batch_size=1024, columns=columns), names, pf.metadata.num_rows
            )

    def _hf_disk(self) -> Iterator[Document]:
        import datasets

        files = self.files()
        for path in files:
            self._hash_file(path)
        folder = str(self.source.path)
        try:
            ds = datasets.load_from_disk(folder)
        except Exception as exc:  # datasets raises FileNotFoundError or its own errors for a wrong folder
            raise CorpusError(
                f"config key 'data.sources.{self.name}.path': {folder} is not a folder written by "
                f"datasets' save_to_disk ({exc}); point it at one"
            ) from None
        if not isinstance(ds, datasets.Dataset):
            raise CorpusError(
                f"config key 'data.sources.{self.name}.path': {folder} holds a DatasetDict "
                f"({', '.join(ds)}); point it at one split's folder, e.g. {folder}/{next(iter(ds))}"
            )
        batches = (ds.data.table.slice(i, 1024) for i in range(0, len(ds), 1024))
        yield from self._table_batches(folder, batches, list(ds.column_names), len(ds))

    def _record(self, record: Any, where: str) -> Document | None:
        """A document from one JSON object / table row, or None (counted) if it is unusable."""
        if not isinstance(record, dict):
            self.bad(
                "invalid_json",
                where,
                f"a JSON {type(record).__name__}, not an object",
                "Write one JSON object per line",
            )
            return None
        if self.messages_field:
            messages = record.get(self.messages_field)
            if messages is None:
                self.bad(
                    "missing_field",
                    where,
                    f"record without the field '{self.messages_field}'",
                    f"Add it, or set data.sources.{self.name}.messages_field",
                )
                return None
            if not (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                self.bad(
                    "invalid_messages",
                    where,
                    f"'{self.messages_field}' is not a non-empty list of {{role, content}} strings",
                    "Fix the record",
                )
                return None
            return Document(
                origin=where, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages)
            )
        text = record.get(self.text_field)
        if text is None:
            fields = ", ".join(sorted(record)) or "none"
            self.bad(
                "missing_field",
                where,
                f"record without the field '{self.text_field}' (fields: {fields})",
                f"Add it, or set data.sources.{self.name}.text_field",
            )
            return None
        if not isinstance(text, str):
            self.bad(
                "missing_field",
                where,
                f"field '{self.text_field}' is a {type(text).__name__}, not a string",
                "Fix the record",
            )
            return None
        return Document(origin=where, text=text)


def split_documents(reader: SourceReader, fractions: Mapping[str, float]) -> Iterator[tuple[str, int, Document]]:
    """``(split, doc_id, document)`` for every distinct document of a source, in order.

    Exact duplicates are dropped (counted in ``reader.duplicate_documents``), so a document id is
    unique within a corpus. Raises if the source yields no document at all.
    """
    seen: set[int] = set()
    for doc in reader.documents():
        digest = doc.digest()
        doc_id = doc_id_of(digest)
        if doc_id in seen:
            reader.duplicate_documents += 1
            continue
        seen.add(doc_id)
        yield split_of(digest, fractions), doc_id, doc
    if not seen:
        raise CorpusError(
            f"corpus '{reader.name}' has no documents after filtering ({reader.describe()}); "
            f"check config key 'data.sources.{reader.name}'"
        )
