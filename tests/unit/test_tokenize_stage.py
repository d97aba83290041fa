"""Tokenizer training, packing, the Arrow shard format and the tokenize stage (manifest, determinism,
atomic output, chat labels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeflow.data.corpus import CorpusError, SourceReader, split_documents
from moeflow.data.packing import Packer, pack_documents
from moeflow.data.sharding import TokenizeStage, tokenize_corpus
from moeflow.data.shards import COLUMNS, iter_rows, open_split, read_documents, row_schema, write_split
from moeflow.data.tokenizer import BOS, EOS, PAD, DocumentEncoder, folder_hash, train_tokenizer_stage
from moeflow.settings import plain, typed

SRC = Path(__file__).resolve().parents[1] / "src"
SPLIT = {"heldout": 0.1, "test": 0.05}
SMALL_STDLIB = {"type": "stdlib", "packages": ["json", "glob", "fnmatch", "textwrap"]}


def settings(sources, seq_len=64, on_bad_record="fail", pad_to_multiple_of=8, shard_max_bytes=1 << 20):
    tok = {
        "tokenizer": {"vocab_size": 400, "min_frequency": 2},
        "pretrained_model": None,
        "sources": sources,
        "split": SPLIT,
        "on_bad_record": on_bad_record,
    }
    data = {
        "seq_len": seq_len,
        "pad_to_multiple_of": pad_to_multiple_of,
        "on_bad_record": on_bad_record,
        "split": SPLIT,
        "shard_max_bytes": shard_max_bytes,
        "sources": sources,
    }
    return typed(TokenizeStage, {"tokenizer": tok, "data": data})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer_stage(settings({"small": SMALL_STDLIB}).tokenizer, out)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- tokenizer


def test_trained_tokenizer_loads_with_autotokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert tok.is_fast and len(tok) == 400
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (EOS, BOS, PAD)
    assert len({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}) == 3
    text = "def f(x):\n    return x  # ünïcode\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_training_is_deterministic_and_uses_the_train_split(tokenizer_dir, tmp_path):
    cfg = settings({"small": SMALL_STDLIB}).tokenizer
    info = train_tokenizer_stage(cfg, tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    reader = SourceReader("small", SMALL_STDLIB)
    train_docs = [d for split, _, d in split_documents(reader, SPLIT) if split == "train"]
    assert info["trained_on"]["texts"] == len(train_docs) < reader.documents_read


# --------------------------------------------------------------------------- packing


def test_packing_fills_rows_and_marks_boundaries():
    docs = [(11, list(range(1, 6)), None), (22, list(range(10, 40)), None), (33, [7, 8, 9], None)]
    rows = list(pack_documents(docs, seq_len=16, pad_to_multiple_of=4, pad_id=0))
    assert [len(r["input_ids"]) for r in rows] == [16, 16, 8]  # 38 tokens; only the last row padded, to 8
    flat = {k: np.concatenate([r[k] for r in rows]) for k in COLUMNS}
    assert flat["input_ids"][:38].tolist() == list(range(1, 6)) + list(range(10, 40)) + [7, 8, 9]
    assert flat["doc_ids"].tolist() == [11] * 5 + [22] * 30 + [33] * 3 + [-1] * 2
    # doc 22 starts at 5 and continues into row 2 at 16 (a new segment), then into row 3 at 32
    starts = np.flatnonzero(flat["position_ids"] == 0).tolist()
    assert starts == [0, 5, 16, 32, 35, 38]
    assert all(flat["labels"][s] == -100 for s in starts)
    assert (flat["labels"][38:] == -100).all()
    others = [i for i in range(38) if i not in starts]
    assert (flat["labels"][others] == flat["input_ids"][others]).all()


def test_pack_stats_and_explicit_labels():
    packer = Packer(seq_len=8, pad_to_multiple_of=64, pad_id=5)
    rows = packer.add(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [-100, -100, -100, 4, 5, -100, 7, 8, 9, 10])
    rows += packer.add(2, [1, 2], None) + packer.finish()
    assert [len(r["input_ids"]) for r in rows] == [8, 8]  # padding never exceeds seq_len
    assert rows[0]["labels"].tolist() == [-100, -100, -100, 4, 5, -100, 7, 8]
    assert rows[1]["labels"].tolist() == [-100, 10, -100, 2, -100, -100, -100, -100]
    stats = packer.stats.summary()
    assert stats["documents"] == 2 and stats["tokens"] == 12 and stats["split_documents"] == 1
    assert stats["padding_tokens"] == 4 and stats["padding_fraction"] == 0.25
    assert stats["pad_to_max_length"]["truncated_fraction"] == 2 / 12
    assert stats["label_tokens"] == 6 + 1


def test_shards_roundtrip_bounded_and_readable_by_datasets_and_pyarrow(tmp_path):
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(0)
    docs = [(i, rng.integers(0, 400, int(n)).tolist(), None) for i, n in enumerate(rng.integers(1, 200, 300), 1)]
    rows = list(pack_documents(docs, seq_len=64, pad_to_multiple_of=8, pad_id=0))
    shards = write_split(tmp_path / "train", rows, shard_max_bytes=40_000)
    assert len(shards) > 1 and all(s["bytes"] <= 40_000 for s in shards)
    assert sum(s["rows"] for s in shards) == len(rows)
    ds = open_split(tmp_path, "train")
    assert len(ds) == len(rows) and set(ds.column_names) == set(COLUMNS)
    first = datasets.Dataset.from_file(str(tmp_path / "train" / "shard-00000.arrow"))
    assert first[0]["input_ids"] == rows[0]["input_ids"].tolist()
    with pa.OSFile(str(tmp_path / "train" / "shard-00000.arrow"), "rb") as fh:
        table = pa.ipc.open_stream(fh).read_all()
    assert table.schema == row_schema()
    # documents come back whole and in order, from the folder and from the Dataset
    expected = [(i, ids) for i, ids, _ in docs]
    assert list(read_documents(tmp_path / "train")) == expected
    assert list(read_documents(ds)) == expected
    # an empty split is one empty shard
    write_split(tmp_path / "test", [], shard_max_bytes=40_000)
    assert len(open_split(tmp_path, "test")) == 0


# --------------------------------------------------------------------------- the stage


def test_stage_packs_stdlib_with_under_one_percent_padding_and_is_deterministic(tokenizer_dir, tmp_path):
    cfg = settings({"email": {"type": "stdlib", "packages": ["email"]}}, seq_len=512, pad_to_multiple_of=64)
    manifest = tokenize_corpus("email", cfg, tokenizer_dir, tmp_path / "a")
    totals = manifest["totals"]
    assert totals["padding_fraction"] < 0.01
    assert (
        totals["pad_to_max_length"]["padding_fraction"] > 10 * totals["padding_fraction"]
        or totals["pad_to_max_length"]["truncated_fraction"] > 0.5
    )
    assert totals["split_documents"] > 0 and manifest["source"]["files"]
    assert manifest["tokenizer"]["sha256"] == folder_hash(tokenizer_dir)
    for split in ("train", "heldout", "test"):
        ds = open_split(tmp_path / "a", split)
        assert (
            sum(len(x) for x in ds["input_ids"])
            == manifest["splits"][split]["tokens"] + manifest["splits"][split]["padding_tokens"]
        )
        assert len(list(read_documents(tmp_path / "a" / split))) == manifest["splits"][split]["documents"]
    splits = {s: {d for d, _ in read_documents(tmp_path / "a" / s)} for s in ("train", "heldout", "test")}
    assert (
        not (splits["train"] & splits["heldout"])
        and not (splits["train"] & splits["test"])
        and not (splits["heldout"] & splits["test"])
    )
    tokenize_corpus("email", cfg, tokenizer_dir, tmp_path / "b")
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")


def test_documents_end_with_eos_and_decode_back(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    texts = [f"print({i} * 'hello world')\n" for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = settings({"code": {"type": "jsonl", "path": str(tmp_path / "d.jsonl")}})
    tokenize_corpus("code", cfg, tokenizer_dir, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    decoded = {tok.decode(ids) for s in ("train", "heldout", "test") for _, ids in read_documents(tmp_path / "out" / s)}
    assert decoded == {t + EOS for t in texts}


def test_chat_labels_only_on_assistant_turns(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is json?"},
        {"role": "assistant", "content": "a data format"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "you are welcome"},
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    source = {"type": "jsonl", "path": str(tmp_path / "c.jsonl"), "messages_field": "messages"}
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    from moeflow.data.corpus import Document, source_settings

    ids, labels = DocumentEncoder(tok, source_settings("c", source)).encode_chat(Document("c", messages=tuple(chat)))
    learned = tok.decode(ids[labels != -100])
    assert learned == "a data format<|im_end|>\nyou are welcome<|im_end|>\n"
    assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)
    _, all_labels = DocumentEncoder(tok, source_settings("c", source | {"assistant_only_labels": False})).encode_chat(
        Document("c", messages=tuple(chat))
    )
    assert (all_labels == ids).all()
    # through the stage: labels in the shards are the assistant tokens (the first token of a row is never labelled)
    manifest = tokenize_corpus("chat", settings({"chat": source}, seq_len=512), tokenizer_dir, tmp_path / "out")
    split = next(s for s in ("train", "heldout", "test") if manifest["splits"][s]["documents"])
    row = next(iter_rows(tmp_path / "out" / split))
    assert tok.decode(row["labels"][row["labels"] != -100]) == learned
    assert manifest["splits"][split]["label_tokens"] == int((labels != -100).sum())


def test_skipped_records_are_counted_in_the_manifest(tokenizer_dir, tmp_path):
    (tmp_path / "d.jsonl").write_bytes(
        b'{"text": "good one"}\n{"text": bad}\n{"body": "x"}\n{"text": "\xff"}\n{"text": "good two"}\n'
    )
    source = {"type": "jsonl", "path": str(tmp_path / "d.jsonl")}
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: not valid JSON"):
        tokenize_corpus("d", settings({"d": source}), tokenizer_dir, tmp_path / "fail")
    assert not (tmp_path / "fail").exists()
    manifest = tokenize_corpus("d", settings({"d": source}, on_bad_record="skip"), tokenizer_dir, tmp_path / "skip")
    assert manifest["read"]["skipped_records"]["counts"] == {"invalid_json": 1, "missing_field": 1, "not_utf8": 1}
    assert manifest["totals"]["documents"] == 2


def test_a_killed_run_leaves_no_output(tokenizer_dir, tmp_path):
    out = tmp_path / "out"
    code = (
        "from moeflow.data.sharding import TokenizeStage, tokenize_corpus; from moeflow.settings import typed; "
        f"tokenize_corpus('small', typed(TokenizeStage, {plain(settings({'small': SMALL_STDLIB}))!r}), "
        f"{str(tokenizer_dir)!r}, {str(out)!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "MOEFLOW_KILL_AT": "tokenize.before_rename"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists()
    assert not list(tmp_path.glob("out"))  # only a hidden temporary sibling may remain
