"""Corpus readers, the content-hash split, and every kind of bad input (fail by default, skip and count)."""

from __future__ import annotations

import json
import platform
from collections import Counter
from pathlib import Path

import pytest

from moeflow.data.corpus import (
    CorpusError,
    Document,
    SourceReader,
    doc_id_of,
    source_files,
    split_documents,
    split_of,
    stdlib_files,
    stdlib_root,
)

FRACTIONS = {"heldout": 0.1, "test": 0.05}


def read_all(cfg, on_bad_record="fail", name="corpus"):
    reader = SourceReader(name, cfg, on_bad_record)
    return reader, list(split_documents(reader, FRACTIONS))


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- stdlib


def test_stdlib_files_leave_out_tests_idlelib_turtledemo():
    files = stdlib_files()
    parts = {part for f in files for part in f.parts[:-1]}
    tops = {f.parts[0] for f in files}
    assert files and all(f.suffix == ".py" for f in files)
    assert not {"test", "tests"} & parts
    assert not {"test", "idlelib", "turtledemo", "site-packages"} & tops
    assert files == sorted(files, key=lambda p: p.as_posix())


def test_stdlib_filter_by_top_level_package_and_fingerprint():
    reader, docs = read_all({"type": "stdlib", "packages": ["json", "glob"]})
    origins = {doc.origin for _, _, doc in docs}
    assert "glob.py" in origins and "json/decoder.py" in origins
    assert all(o == "glob.py" or o.startswith("json/") for o in origins)
    fp = reader.fingerprint()
    assert fp["python"] == platform.python_version()
    assert fp["files"]["glob.py"] == __import__("hashlib").sha256((stdlib_root() / "glob.py").read_bytes()).hexdigest()
    _, rest = read_all({"type": "stdlib", "packages": ["json", "glob"], "exclude_packages": ["json"]})
    assert {d.origin for _, _, d in rest} == {"glob.py"}


def test_stdlib_unknown_package_is_an_error():
    with pytest.raises(CorpusError, match=r"data\.sources\.corpus\.packages.*no_such_pkg"):
        read_all({"type": "stdlib", "packages": ["no_such_pkg"]})


def test_source_files_for_the_snakefile(tmp_path):
    assert source_files({"type": "stdlib"}) == []
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "notes.md").write_text("x")
    expected = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert source_files({"type": "jsonl", "path": str(tmp_path / "*.jsonl")}) == expected
    assert source_files({"type": "jsonl", "path": str(tmp_path)}) == expected
    assert source_files({"type": "jsonl", "path": str(tmp_path / "missing.jsonl")}) == []


# --------------------------------------------------------------------------- split


def test_split_is_by_content_and_stable_when_documents_change():
    docs = [Document(origin=str(i), text=f"document number {i}\n") for i in range(2000)]
    assign = {d.text: split_of(d.digest(), FRACTIONS) for d in docs}
    counts = Counter(assign.values())
    assert abs(counts["heldout"] / 2000 - 0.1) < 0.03 and abs(counts["test"] / 2000 - 0.05) < 0.02
    # removing half the documents and adding new ones moves nobody
    changed = docs[::2] + [Document(origin="new", text=f"new {i}") for i in range(500)]
    assert all(split_of(d.digest(), FRACTIONS) == assign[d.text] for d in changed if d.text in assign)
    # ids are stable non-negative int64s, derived from the content only
    ids = {doc_id_of(d.digest()) for d in docs}
    assert len(ids) == 2000 and all(0 <= i < 2**63 for i in ids)
    assert doc_id_of(Document("elsewhere", text=docs[0].text).digest()) == doc_id_of(docs[0].digest())


def test_duplicates_are_dropped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "same"}, {"text": "other"}, {"text": "same"}])
    reader, docs = read_all({"type": "jsonl", "path": str(path)})
    assert [d.text for _, _, d in docs] == ["same", "other"]
    assert reader.duplicate_documents == 1
    assert len({doc_id for _, doc_id, _ in docs}) == 2


# --------------------------------------------------------------------------- readers


def test_jsonl_text_field_and_chat_messages(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "hello"}, {"body": "world"}])
    _, docs = read_all({"type": "jsonl", "path": str(path), "text_field": "body"})
    assert [d.text for _, _, d in docs] == ["hello", "world"]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    _, docs = read_all({"type": "jsonl", "path": str(path), "messages_field": "messages"})
    assert docs[0][2].messages == tuple(chat) and docs[0][2].text is None


def test_parquet_text_glob_and_saved_dataset(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2"], "n": [1, 2]}), tmp_path / "x.parquet")
    _, docs = read_all({"type": "parquet", "path": str(tmp_path / "x.parquet")})
    assert [d.text for _, _, d in docs] == ["p1", "p2"]

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "b.txt").write_text("second")
    (tmp_path / "txt" / "a.txt").write_text("first")
    _, docs = read_all({"type": "text", "path": str(tmp_path / "txt" / "*.txt")})
    assert [d.text for _, _, d in docs] == ["first", "second"]

    datasets.Dataset.from_dict({"text": ["s1", "s2", "s3"]}).save_to_disk(str(tmp_path / "saved"))
    reader, docs = read_all({"type": "hf_disk", "path": str(tmp_path / "saved")})
    assert [d.text for _, _, d in docs] == ["s1", "s2", "s3"]
    assert reader.fingerprint()["files"]


# --------------------------------------------------------------------------- bad input


def bad_cases(tmp_path: Path):
    """(description, source config, expected location in the message, skip count key)."""
    (tmp_path / "invalid.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "good.txt").write_text("fine")
    (tmp_path / "txt" / "empty.txt").write_bytes(b"")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "good.txt").write_text("fine")
    (tmp_path / "bin" / "bad.txt").write_bytes(b"line one\nline \xff two\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "empty" / "b.jsonl").write_bytes(b"")
    return [
        ("invalid JSON", {"type": "jsonl", "path": str(tmp_path / "invalid.jsonl")}, "invalid.jsonl:2", "invalid_json"),
        ("not UTF-8 (jsonl)", {"type": "jsonl", "path": str(tmp_path / "latin1.jsonl")}, "latin1.jsonl:2", "not_utf8"),
        ("not UTF-8 (text)", {"type": "text", "path": str(tmp_path / "bin")}, "bad.txt:2", "not_utf8"),
        (
            "missing field",
            {"type": "jsonl", "path": str(tmp_path / "nofield.jsonl")},
            "nofield.jsonl:2",
            "missing_field",
        ),
        ("empty file (text)", {"type": "text", "path": str(tmp_path / "txt")}, "empty.txt", "empty_file"),
        ("empty file (jsonl)", {"type": "jsonl", "path": str(tmp_path / "empty")}, "b.jsonl", "empty_file"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_input_fails_with_file_line_and_what_to_do(tmp_path, case):
    _, cfg, where, _ = bad_cases(tmp_path)[case]
    with pytest.raises(CorpusError) as err:
        read_all(cfg)
    message = str(err.value)
    assert where in message and "data.on_bad_record: skip" in message


@pytest.mark.parametrize("case", range(6))
def test_bad_input_is_skipped_and_counted(tmp_path, case):
    _, cfg, where, kind = bad_cases(tmp_path)[case]
    reader, docs = read_all(cfg, on_bad_record="skip")
    assert docs, "the good records are kept"
    skipped = reader.skipped()
    assert skipped["counts"] == {kind: 1} and skipped["total"] == 1
    assert where in skipped["examples"][0]


def test_missing_field_in_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
    with pytest.raises(CorpusError, match=r"x\.parquet: no column 'text'.*text_field"):
        read_all({"type": "parquet", "path": str(tmp_path / "x.parquet")})


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(CorpusError, match=r"data\.sources\.corpus\.path.*nope\.jsonl.*fix the path"):
        read_all({"type": "jsonl", "path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(CorpusError, match="no file matches"):
        read_all({"type": "text", "path": str(tmp_path / "*.txt")})


def test_empty_corpus_after_filtering_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "blank.jsonl", [{"text": "   "}, {"text": ""}])
    with pytest.raises(CorpusError, match="no documents after filtering.*2 empty documents"):
        read_all({"type": "jsonl", "path": str(path)})
    path = write_jsonl(tmp_path / "all_bad.jsonl", [{"body": "x"}])
    with pytest.raises(CorpusError, match="no documents after filtering.*1 skipped"):
        read_all({"type": "jsonl", "path": str(path)}, on_bad_record="skip")
    with pytest.raises(CorpusError, match="no documents after filtering"):
        read_all({"type": "stdlib", "packages": ["json"], "exclude_packages": ["json"]})


def test_keys_that_do_not_apply_to_a_source_type_are_rejected():
    with pytest.raises(CorpusError, match=r"data\.sources\.corpus.*path do not apply to a source of type stdlib"):
        SourceReader("corpus", {"type": "stdlib", "path": "x"})
    with pytest.raises(CorpusError, match=r"packages do not apply to a source of type jsonl"):
        SourceReader("corpus", {"type": "jsonl", "path": "x", "packages": ["json"]})
