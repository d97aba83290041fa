"""Atomic output: a failed write never leaves something that looks finished, and never loses the old one."""

from __future__ import annotations

import os
import stat

import pytest

from moeflow.runtime.files import atomic_dir, atomic_file, read_json, write_json


def test_write_json_is_sorted_and_stable(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    first = (tmp_path / "a.json").read_bytes()
    write_json(tmp_path / "a.json", {"a": [1, 2], "b": 1})
    assert (tmp_path / "a.json").read_bytes() == first == b'{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert read_json(tmp_path / "a.json") == {"a": [1, 2], "b": 1}


def test_failed_file_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as fh:
            fh.write("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out.txt"]


def test_failed_folder_write_keeps_the_old_folder(tmp_path):
    target = tmp_path / "shards"
    with atomic_dir(target) as tmp:
        (tmp / "shard-0.arrow").write_text("complete")
    with pytest.raises(OSError):
        with atomic_dir(target) as tmp:
            (tmp / "shard-0.arrow").write_text("partial")
            raise OSError(28, "No space left on device")
    assert (target / "shard-0.arrow").read_text() == "complete"
    assert sorted(os.listdir(tmp_path)) == ["shards"]


def test_outputs_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_json(tmp_path / "m.json", {})
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "x").write_text("x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "m.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
