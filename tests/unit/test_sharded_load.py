"""moeflow.parallel.rank_load in one process, through moeflow.loading.factory.make_model: a model built on the
meta device and filled from its folder's files equals ``from_pretrained``'s, a rank's rows come from the file
tensors that hold them (transformers 5's fused experts from their per-expert file tensors), and a folder that
does not fit is a clear error. The same on two ranks (FSDP shards): tests/pipeline/test_sharded_state.py."""

from __future__ import annotations

import json

import pytest
import torch
from gloo_ranks import run_ranks
from tiny_models import tiny_model_cfg

import moeflow.loading.factory
from moeflow.loading.factory import Layout, make_model
from moeflow.model.configs import causal_lm_class
from moeflow.model.folder import check_model_folder
from moeflow.model.safetensors_files import SafetensorsError, read_header, weight_files
from moeflow.model.settings import ModelSettings
from moeflow.parallel import layouts, rank_load
from moeflow.parallel.process_group import Ranks
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.settings import typed
from moeflow.train.settings import TrainSettings
from moeflow.workflow.keys import training

VOCAB = 96
ONE_RANK = Ranks(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
FSDP = typed(ParallelSettings, {"strategy": "fsdp"})


def settings() -> ModelSettings:
    return typed(ModelSettings, tiny_model_cfg())


def saved(tmp_path, tied=True, **save):
    folder = tmp_path / f"model-{tied}-{len(save)}"
    model = make_model(typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=tied)), vocab_size=VOCAB, seed=3)
    model.save_pretrained(folder, **save)
    return folder


def whole(folder):
    """The reference: transformers' own load of the folder."""
    return causal_lm_class().from_pretrained(folder)


def filled(folder):
    """``parallel.strategy: fsdp`` at one rank: built on the meta device, then filled from the folder's files."""
    return make_model(settings(), folder=folder, layout=Layout(ONE_RANK, FSDP, _train("full")))


def assert_same_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state) == sorted(want_state)
    for name, value in want_state.items():
        assert torch.equal(got_state[name], value), name
    assert {n: b for n, b in got.named_buffers()}.keys() == {n: b for n, b in want.named_buffers()}.keys()
    for (name, b), (_, w) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(b, w), name


def test_built_on_meta_holds_no_parameter_memory_but_real_buffers(tmp_path, monkeypatch):
    """The model the fsdp layout shards, as ``shard_model`` gets it: before any parameter has storage."""
    folder = saved(tmp_path)
    loaded = whole(folder)
    materialize, checked = layouts.materialize, []

    def check_then_materialize(model, device):
        assert all(p.is_meta for p in model.parameters())
        buffers = dict(loaded.named_buffers())
        assert buffers and all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())  # rotary inv_freq
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not model.training and model.generation_config.to_dict() == loaded.generation_config.to_dict()
        checked.append(model)
        return materialize(model, device)

    monkeypatch.setattr(layouts, "materialize", check_then_materialize)
    assert filled(folder) is checked[0]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("files", ["one", "hf-sharded"])
def test_filled_from_the_files_equals_from_pretrained(tmp_path, tied, files):
    folder = saved(tmp_path, tied, **({"max_shard_size": "20KB"} if files == "hf-sharded" else {}))
    assert (folder / "model.safetensors.index.json").is_file() == (files == "hf-sharded")
    assert check_model_folder(folder) == folder
    model = filled(folder)
    assert_same_state(model, whole(folder))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_a_rank_reads_only_the_file_tensors_of_its_rows(tmp_path, monkeypatch):
    """The rows a shard owns, filled through ``_fill_piece`` as for an FSDP shard: each parameter's rows 1..2
    equal the whole tensor's, and only the file tensors overlapping those rows are read (transformers 5:
    experts 1 and 2 of a fused expert weight, from their per-expert file tensors)."""
    folder = saved(tmp_path, tied=False)
    loaded = whole(folder)
    files = weight_files(folder)
    headers = {f: read_header(f)[0] for f in set(files.values())}
    reads = []
    read_tensor = rank_load.read_tensor

    def recording(file, entry, rows=None, out=None):
        reads.append((entry.name, rows))
        return read_tensor(file, entry, rows, out)

    monkeypatch.setattr(rank_load, "read_tensor", recording)
    fused = 0
    for name, param in loaded.named_parameters():
        if param.dim() < 2 or param.shape[0] < 3:
            continue
        stored = name if name in files else None
        sources = {stored: None} if stored else rank_load.file_sources(loaded, name, tuple(param.shape))
        local = torch.full((2, *param.shape[1:]), float("nan"))
        reads.clear()
        rank_load._fill_piece(folder, files, headers, name, tuple(param.shape), sources, local, 1)
        assert torch.equal(local, param.detach()[1:3]), name
        if stored is None:  # a fused weight: the file tensors of experts 1 and 2 only
            fused += 1
            assert reads and all(".experts.1." in r or ".experts.2." in r for r, _ in reads), reads
        else:  # the rows themselves, nothing more
            assert reads == [(name, range(1, 3))], reads
    assert fused == (4 if compat.is_transformers_v5() else 0)  # gate_up_proj and down_proj of 2 layers


def _write_without(folder, out, drop=None, reshape=None):
    """A copy of a one-file model folder without tensor ``drop`` or with ``reshape`` given another shape."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][:-1].contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_folder_that_does_not_fit_is_an_error_naming_the_file_and_tensor(tmp_path):
    folder = saved(tmp_path, tied=False)
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(SafetensorsError, match=rf"{name}.*none of its"):
        filled(_write_without(folder, tmp_path / "missing", drop=name))
    with pytest.raises(SafetensorsError, match=rf"model.safetensors: tensor '{name}' has shape \[31, 32\].*\[32, 32\]"):
        filled(_write_without(folder, tmp_path / "shape", reshape=name))
    sharded = saved(tmp_path, tied=False, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "model-00099-of-00099.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="model-00099-of-00099.safetensors"):
        filled(sharded)


def _train(method: str) -> TrainSettings:
    section = {"steps": 1, "lr": 1e-3, "method": method} | ({"lora": {"rank": 2}} if method == "lora" else {})
    return typed(TrainSettings, training(section))


def test_without_weights_no_model_reads_any_and_lora_gets_its_seeded_start(tmp_path, monkeypatch):
    from moeflow.model.lora import initial_adapters
    from moeflow.model.parameters import clean_name, is_adapter

    folder = saved(tmp_path)
    loaded = whole(folder)
    fill = moeflow.loading.factory.fill_from_folder
    monkeypatch.setattr("moeflow.loading.factory.fill_from_folder", lambda *a: pytest.fail("read the weights"))
    model = make_model(settings(), folder=folder, layout=Layout.single("cpu", _train("full")), weights=False)
    assert not any(p.is_meta for p in model.parameters())
    assert sorted(model.state_dict()) == sorted(loaded.state_dict())
    assert torch.equal(model.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)
    lora_model = make_model(settings(), folder=folder, layout=Layout.single("cpu", _train("lora")), weights=False)
    assert not any(p.is_meta for p in lora_model.parameters())
    start = initial_adapters(lora_model, seed=0)
    adapters = {clean_name(n): p for n, p in lora_model.named_parameters() if is_adapter(n)}
    assert sorted(adapters) == sorted(start) and all(torch.equal(adapters[n], start[n]) for n in start)
    assert any(t.abs().sum() > 0 for n, t in start.items() if ".lora_A." in n)
    assert all(t.abs().sum() == 0 for n, t in start.items() if ".lora_B." in n)  # the adapted model is the base
    monkeypatch.setattr("moeflow.loading.factory.fill_from_folder", fill)
    lora_model = make_model(settings(), folder=folder, layout=Layout.single("cpu", _train("lora")))
    merged = lora_model.merge_and_unload().state_dict()  # the base read from the folder under the adapters
    assert sorted(merged) == sorted(loaded.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("strategy", ["none", "fsdp"])
def test_a_full_model_at_one_rank_fills_from_the_files_not_from_pretrained(tmp_path, monkeypatch, strategy):
    """``none`` and ``fsdp`` read the weights themselves at any number of ranks (one copy of the weights:
    transformers 5's ``from_pretrained`` keeps the files mapped beside the tensors it copies), and give
    ``from_pretrained``'s model."""
    folder = saved(tmp_path, tied=False)
    loaded = whole(folder)
    auto_class = causal_lm_class()
    monkeypatch.setattr(auto_class, "from_pretrained", lambda *a, **k: pytest.fail("from_pretrained"))
    parallel = typed(ParallelSettings, {"strategy": strategy})
    assert_same_state(make_model(settings(), folder=folder, layout=Layout(ONE_RANK, parallel, _train("full"))), loaded)
    if strategy == "none":
        assert_same_state(make_model(settings(), folder=folder), loaded)  # evaluation's one process


def _kept_class(base: type) -> type:
    """DeepSeek-V3's class keeping its routers in float32 on both stacks (transformers 5's own list; 4.57's class
    has none) plus a layer norm of each list, which neither stack's class builds in float32 itself."""

    # transformers 4.57 matches whole module names (and refuses a buffer's); transformers 5 searches each key
    routers = ["e_score_correction_bias", "gate.weight"] if compat.is_transformers_v5() else ["gate"]

    class Kept(base):
        _keep_in_fp32_modules = ["kv_a_layernorm"]  # float16 only
        _keep_in_fp32_modules_strict = [*routers, "q_a_layernorm"]

    return Kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_load_in_half_precision_keeps_in_float32_what_from_pretrained_keeps(tmp_path, monkeypatch, dtype):
    """The sharded loader in bf16 (and fp16) keeps the model class's ``_keep_in_fp32_modules(_strict)`` in float32
    as ``from_pretrained`` does (DeepSeek-V3's and Step-3.5's routers would otherwise route in bf16 on a GPU):
    every parameter and buffer has from_pretrained's dtype and value."""
    from tiny_models import build_family, folder_settings

    base = build_family("deepseek_v3", dtype=torch.float32)
    base.save_pretrained(tmp_path / "ds")
    kept = _kept_class(type(base))
    want = kept.from_pretrained(tmp_path / "ds", torch_dtype=dtype).eval()
    as_auto_class = type(
        "AsAutoClass",
        (),
        {
            "from_config": staticmethod(lambda config, trust_remote_code, **kw: kept._from_config(config, **kw)),
            "from_pretrained": kept.from_pretrained,
        },
    )
    monkeypatch.setattr("moeflow.loading.factory.causal_lm_class", lambda: as_auto_class)
    got = make_model(folder_settings(experts_implementation="eager"), folder=tmp_path / "ds", dtype=dtype)
    fp32 = {n for n, t in want.state_dict().items() if t.dtype == torch.float32}
    layer_norms = {"kv_a_layernorm", "q_a_layernorm"} if dtype == torch.float16 else {"q_a_layernorm"}
    assert {n.split(".")[-2] for n in fp32} == layer_norms | {"gate"}, fp32
    assert {n for n, t in got.state_dict().items() if t.dtype == torch.float32} == fp32
    assert_same_state(got, want)


def test_a_rank_places_only_the_file_tensors_of_its_rows_and_builds_no_whole_tensor_index(tmp_path, monkeypatch):
    """``file_sources`` for a rank's rows (experts 1..2 of 4): every file tensor is named and placed by rows,
    but element positions are kept only for that rank's, and the probes given to transformers' conversion are
    broadcast (one index per row, one per position in a row), never an index per element of the whole tensor."""
    loaded = whole(saved(tmp_path, tied=False))
    fused = [(n, p) for n, p in loaded.named_parameters() if ".experts." in n and p.dim() == 3]
    assert len(fused) == (4 if compat.is_transformers_v5() else 0)
    probes = []
    saved_format = rank_load.saved_format

    def recording(model, tensors):
        probes.extend(tensors.values())
        return saved_format(model, tensors)

    monkeypatch.setattr(rank_load, "saved_format", recording)
    for name, param in fused:
        probes.clear()
        sources = rank_load.file_sources(loaded, name, tuple(param.shape), range(1, 3))
        assert len(sources) == param.shape[0] * (2 if "gate_up" in name else 1)  # per expert: gate and up, or down
        assert probes and all(p.untyped_storage().nbytes() <= 4 * max(p.shape[0], p[0].numel()) for p in probes)
        for stored, source in sources.items():  # each per-expert tensor lies in its expert's row
            expert = int(stored.split(".experts.")[1].split(".")[0])
            assert source.first_row == source.last_row == expert, stored
            assert (source.within is not None) == (expert in (1, 2)), stored


def _permuted_folder(tmp_path, weight):
    """A folder whose file tensor ``w.shuffled`` holds the model's ``w`` with each row's elements permuted (the
    layout of no real model, one the contiguous-block path cannot read): file row i holds model row i."""
    from safetensors.torch import save_file

    folder = tmp_path / "permuted"
    folder.mkdir()
    rows, cols = weight.shape
    save_file(
        {"w.shuffled": weight.reshape(rows, 2, cols // 2).transpose(1, 2).contiguous()},
        str(folder / "model.safetensors"),
    )
    return folder


def _permuted_format(model, tensors):
    ((name, t),) = tensors.items()
    rows, cols = t.shape
    return {f"{name}.shuffled": t.reshape(rows, 2, cols // 2).transpose(1, 2)}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_partly_owned_file_tensor_is_read_by_its_rows_onto_the_shards_device(tmp_path, monkeypatch, device):
    """The fallback for a file tensor that is no contiguous block of the model's: the rank reads only the file
    rows holding its elements (rows 1..2 of 4 here), and writes them on its shard's device (a CUDA shard on a
    GPU; the meta device stands in here, which refuses values from another device)."""
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    folder = _permuted_folder(tmp_path, weight)
    monkeypatch.setattr(rank_load, "saved_format", _permuted_format)
    files = weight_files(folder)
    headers = {f: read_header(f)[0] for f in set(files.values())}
    sources = rank_load.file_sources(None, "w", (4, 6))
    assert list(sources) == ["w.shuffled"] and sources["w.shuffled"].first_row == 0
    reads = []
    read_tensor = rank_load.read_tensor

    def recording(file, entry, rows=None, out=None):
        reads.append(rows)
        return read_tensor(file, entry, rows, out)

    monkeypatch.setattr(rank_load, "read_tensor", recording)
    local = torch.full((2, 6), float("nan"), device=device)
    rank_load._fill_piece(folder, files, headers, "w", (4, 6), sources, local, 1)
    assert reads == [range(1, 3)]
    if device == "cpu":
        assert torch.equal(local, weight[1:3])
    reads.clear()
    rank_load._fill_piece(folder, files, headers, "w", (4, 6), sources, torch.empty(1, 6), 0)
    assert reads == [range(0, 1)]


def _rows_rank(rank: int, init_file: str, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed import tensor as dtensor
    from torch.distributed.device_mesh import init_device_mesh

    from moeflow.parallel.process_group import destroy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        distribute = dtensor.distribute_tensor
        probes = []
        dtensor.distribute_tensor = lambda t, *a, **k: probes.append(t.shape) or distribute(t, *a, **k)
        whole = {f"w{i}": torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3) + i for i in range(6)}
        whole["odd"] = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2)
        placed = {n: distribute(t, mesh, [dtensor.Shard(0)]) for n, t in whole.items()}
        pieces = {n: rank_load.local_pieces(t) for n, t in placed.items()}
        results[rank] = {
            "pieces": {n: [(local.tolist(), offset) for local, offset in found] for n, found in pieces.items()},
            "probes": [list(shape) for shape in probes],
        }
    finally:
        destroy()


@pytest.mark.skipif(not compat.fsdp2_available(), reason="DTensor placements: FSDP2's torch (current stack)")
def test_dtensor_rows_are_found_once_per_layout_not_once_per_tensor(tmp_path):
    """Two gloo ranks, FSDP2's ``Shard(0)``: each rank's pieces are its rows with their row offsets, and the row
    layout is probed once per (rows, placements), not once per tensor (each probe read back from a GPU waits
    for the device: about 530 tensors in Qwen3-30B-A3B)."""
    results = run_ranks(_rows_rank, str(tmp_path / "init"))
    whole = {f"w{i}": torch.arange(15.0).reshape(5, 3) + i for i in range(6)} | {
        "odd": torch.arange(14.0).reshape(7, 2)
    }
    for rank, (first, stop) in enumerate([(0, 3), (3, 5)]):
        assert results[rank]["probes"] == [[5], [7]]
        for name, found in results[rank]["pieces"].items():
            rows = (first, stop) if name != "odd" else [(0, 4), (4, 7)][rank]
            offset = (rows[0], 0)
            assert found == [(whole[name][rows[0] : rows[1]].tolist(), offset)], (rank, name)
