"""moeflow.model.safetensors_files: files the safetensors library reads and writes, streamed a tensor at a time."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeflow.model.safetensors_files import (
    SafetensorsError,
    SafetensorsWriter,
    read_header,
    read_tensor,
    weight_files,
)

TENSORS = {
    "a.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4),
    "b.bf16": torch.linspace(-3, 3, 10).to(torch.bfloat16).reshape(5, 2),
    "c.step": torch.tensor(7.0),
    "d.ids": torch.arange(5, dtype=torch.int64),
    "e.empty": torch.zeros(0, 3),
}


def layout(tensors):
    return [(name, t.dtype, t.shape) for name, t in tensors.items()]


def test_streamed_file_is_what_safetensors_reads(tmp_path):
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, layout(TENSORS), metadata={"format": "pt"}) as writer:
        for name, tensor in TENSORS.items():
            writer.write(name, tensor)
    loaded = load_file(str(path))
    assert loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_rows_read_from_a_file_safetensors_wrote(tmp_path):
    path = tmp_path / "y.safetensors"
    save_file(TENSORS, str(path))
    entries, _ = read_header(path)
    assert torch.equal(read_tensor(path, entries["a.weight"], range(2, 5)), TENSORS["a.weight"][2:5])
    assert torch.equal(read_tensor(path, entries["b.bf16"]), TENSORS["b.bf16"])
    assert torch.equal(read_tensor(path, entries["c.step"]), TENSORS["c.step"])
    out = torch.empty(1, 2, dtype=torch.bfloat16)
    assert read_tensor(path, entries["b.bf16"], range(4, 5), out=out) is out
    assert torch.equal(out, TENSORS["b.bf16"][4:5])
    with pytest.raises(SafetensorsError, match="a.weight"):
        read_tensor(path, entries["a.weight"], range(0, 2), out=torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(SafetensorsError, match="rows"):
        read_tensor(path, entries["a.weight"], range(4, 7))


def test_writer_refuses_a_tensor_out_of_layout_and_an_unfinished_file(tmp_path):
    with pytest.raises(SafetensorsError, match="expected tensor 'a.weight'"):
        with SafetensorsWriter(tmp_path / "z.safetensors", layout(TENSORS)) as writer:
            writer.write("b.bf16", TENSORS["b.bf16"])
    with pytest.raises(SafetensorsError, match="never written"):
        with SafetensorsWriter(tmp_path / "w.safetensors", layout(TENSORS)) as writer:
            writer.write("a.weight", TENSORS["a.weight"])


def test_weight_files_of_a_single_file_and_of_an_index(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    save_file(TENSORS, str(single / "model.safetensors"))
    assert set(weight_files(single)) == set(TENSORS)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": TENSORS["a.weight"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"d.ids": TENSORS["d.ids"]}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "d.ids": "model-00002-of-00002.safetensors"},
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    files = weight_files(sharded)
    assert files["d.ids"].name == "model-00002-of-00002.safetensors"
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SafetensorsError, match="model-00002-of-00002.safetensors"):
        weight_files(sharded)
    with pytest.raises(SafetensorsError, match="neither"):
        weight_files(tmp_path)
