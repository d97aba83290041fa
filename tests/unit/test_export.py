"""moeflow.checkpoint.export in one process: the streamed folder holds what save_pretrained writes (names, tensors,
config), split into files of at most ``max_shard_size`` with HF's index, loads with from_pretrained, is
fed one tensor at a time, is atomic, and a LoRA model is merged as ``merge_and_unload`` merges it.
The same on two ranks (FSDP, expert parallelism): tests/pipeline/test_sharded_state.py."""

from __future__ import annotations

import json

import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file
from tiny_models import tiny_model_cfg

from moeflow.checkpoint import export
from moeflow.loading.factory import make_model
from moeflow.model import lora
from moeflow.model.safetensors_files import weight_files
from moeflow.model.saved_names import saved_format
from moeflow.model.settings import ModelSettings
from moeflow.settings import typed
from moeflow.train.settings import LoraSettings

VOCAB = 96


def tiny(tied=True, seed=3):
    return make_model(typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=tied)), vocab_size=VOCAB, seed=seed)


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    files = weight_files(folder)
    return {name: t for file in sorted(set(files.values())) for name, t in load_file(str(file)).items()}


@pytest.mark.parametrize("size,expected", [("5GB", 5 * 10**9), ("200KB", 200_000), ("1GiB", 2**30), (7, 7)])
def test_sizes_are_read_as_save_pretrained_reads_them(size, expected):
    assert export.size_in_bytes(size) == expected


def test_a_size_without_a_unit_is_an_error_naming_the_key():
    with pytest.raises(export.ExportError, match="export.max_shard_size '5 parsecs'"):
        export.size_in_bytes("5 parsecs")


def test_files_take_tensors_up_to_the_limit_and_a_larger_tensor_gets_its_own():
    f32 = torch.float32
    specs = [("a", f32, (10,)), ("b", f32, (10,)), ("big", f32, (100,)), ("c", f32, (5,)), ("d", f32, (20,))]
    layouts = export.shard_layouts(specs, max_shard_size=100)
    assert [[name for name, _, _ in layout] for layout in layouts] == [["a", "b"], ["big"], ["c", "d"]]
    assert export.file_names(1) == ["model.safetensors"]
    assert export.file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("tied", [True, False])
def test_the_folder_holds_what_save_pretrained_writes_and_loads_with_from_pretrained(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model = tiny(tied)
    model.config.use_cache = False  # as training leaves it
    model.save_pretrained(tmp_path / "reference")
    export.save_final_model(model, None, tmp_path / "one", max_shard_size="5GB")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == sorted(
        p.name for p in (tmp_path / "reference").iterdir()
    )  # config.json, generation_config.json, model.safetensors
    reference = folder_tensors(tmp_path / "reference")
    for folder in ("one",):
        got = folder_tensors(tmp_path / folder)
        assert sorted(got) == sorted(reference)  # save_pretrained's names: tied weights once
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    want_config = json.loads((tmp_path / "reference" / "config.json").read_text()) | {"use_cache": True}
    assert json.loads((tmp_path / "one" / "config.json").read_text()) == want_config
    assert model.config.use_cache is False  # the run's model is left as it was

    export.save_final_model(model, None, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    sizes = {
        f: sum(t.numel() * t.element_size() for t in load_file(str(tmp_path / "sharded" / f)).values()) for f in files
    }
    assert all(size <= 20_000 for size in sizes.values()) and index["metadata"]["total_size"] == sum(sizes.values())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").state_dict()
    trained = model.state_dict()
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_the_writer_is_fed_each_tensor_before_the_next_is_gathered(tmp_path, monkeypatch):
    """Rank 0 never holds more than one whole tensor beyond its shards: each tensor made whole is written
    (all of its saved pieces) before the next one is made whole."""
    events = []
    whole, write = export._whole, export.ShardedWriter.write
    monkeypatch.setattr(export, "_whole", lambda t: (events.append("gather"), whole(t))[1])
    monkeypatch.setattr(
        export.ShardedWriter, "write", lambda self, n, t: (events.append("write"), write(self, n, t))[1]
    )
    export.save_final_model(tiny(), None, tmp_path / "model", max_shard_size="20KB")
    assert events.count("gather") == len(export.model_tensors(tiny())) > 10
    assert all(after == "write" for before, after in zip(events, events[1:]) if before == "gather")


def test_a_failed_export_leaves_the_previous_folder_whole(tmp_path, monkeypatch):
    export.save_final_model(tiny(seed=1), None, tmp_path / "model", max_shard_size="20KB")
    before = folder_tensors(tmp_path / "model")
    write = export.ShardedWriter.write
    calls = []

    def fail_at_the_fifth(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise OSError("disk gone")
        write(self, name, tensor)

    monkeypatch.setattr(export.ShardedWriter, "write", fail_at_the_fifth)
    with pytest.raises(OSError, match="disk gone"):
        export.save_final_model(tiny(seed=2), None, tmp_path / "model", max_shard_size="20KB")
    after = folder_tensors(tmp_path / "model")
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left


def test_a_lora_model_is_merged_as_merge_and_unload_merges_it(tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    settings = typed(LoraSettings, {"rank": 4})
    model = lora.apply_lora(tiny(), settings, gradient_checkpointing=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    want = copy.deepcopy(model).merge_and_unload(safe_merge=True).state_dict()
    export.save_final_model(model, None, tmp_path / "merged", max_shard_size="20KB")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert sorted(loaded) == sorted(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    assert not torch.equal(
        want["model.layers.0.self_attn.q_proj.weight"], tiny().state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )


# --------------------------------------------------------------------------- FSDP1's whole tensors, exactly

SPECIAL = [0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 1e-40, 3.14159]


def _ranks_buffers(whole: torch.Tensor) -> list[torch.Tensor]:
    """Two ranks' zero buffers of the whole, each holding its range of the elements (FSDP1's flat shards)."""
    cut = whole.numel() // 2 + 1
    first, second = torch.zeros_like(whole), torch.zeros_like(whole)
    first[:cut], second[cut:] = whole[:cut], whole[cut:]
    return [first, second]


def _reduce_rank(rank: int, init_file: str, results: dict) -> None:
    import torch.distributed as dist

    from moeflow.parallel.process_group import destroy, exact_sum_view

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mine = _ranks_buffers(torch.tensor(SPECIAL, dtype=torch.bfloat16))[rank]
        dist.reduce(exact_sum_view(mine), dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:
            results["whole"] = mine.view(torch.int16).tolist()
    finally:
        destroy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int16])
def test_the_ranks_elements_sum_into_the_exact_whole_as_integers_nccl_has(dtype):
    from moeflow.parallel.process_group import NCCL_INTEGER_DTYPES, exact_sum_view

    values = SPECIAL if dtype.is_floating_point else [0, -1, 7, -32768, 32767, 12, 3, 5, 9]
    whole = torch.tensor(values, dtype=dtype)
    views = [exact_sum_view(b) for b in _ranks_buffers(whole)]
    assert views[0].dtype in NCCL_INTEGER_DTYPES  # NCCL has no int16: 2-byte masters travel as bytes
    summed = (views[0] + views[1]).view(dtype)  # what the reduce computes (integer adds, one rank nonzero)
    same_bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert torch.equal(summed.view(same_bits), whole.view(same_bits))  # -0.0's sign and NaN's bits too


def test_two_gloo_ranks_reduce_bf16_pieces_into_the_exact_whole(tmp_path):
    got = run_ranks(_reduce_rank, str(tmp_path / "init"))["whole"]
    assert got == torch.tensor(SPECIAL, dtype=torch.bfloat16).view(torch.int16).tolist()


def test_the_export_is_written_in_the_base_folders_own_dtype_unless_configured(tmp_path):
    """``export.dtype: auto``: a model fine-tuned from a bf16 folder (fp32 masters) is written in bf16, as published,
    not at twice the size; a set dtype wins; without a source, the parameters' own dtype."""
    source = tmp_path / "bf16-base"
    tiny().to(torch.bfloat16).save_pretrained(source)
    assert json.loads((source / "config.json").read_text()).get("torch_dtype", "bfloat16") == "bfloat16"
    model = tiny()  # fp32, as training holds it
    assert export.export_dtype("auto", source, model) == torch.bfloat16
    assert export.export_dtype("fp32", source, model) == torch.float32
    assert export.export_dtype("auto", None, model) == torch.float32
    export.save_final_model(model, None, tmp_path / "out", "5GB", source=source, dtype=torch.bfloat16)
    written = folder_tensors(tmp_path / "out")
    state = saved_format(model, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    assert written and all(t.dtype == torch.bfloat16 for t in written.values())
    assert all(torch.equal(t, state[name].to(torch.bfloat16)) for name, t in written.items())
    # a configured dtype other than the source's: the copied config.json names it, its other keys as they were
    export.save_final_model(model, None, tmp_path / "as-fp32", "5GB", source=source, dtype=torch.float32)
    copied, original = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "as-fp32", source))
    assert {t.dtype for t in folder_tensors(tmp_path / "as-fp32").values()} == {torch.float32}
    assert copied == original | dict.fromkeys(
        [k for k in ("torch_dtype", "dtype") if k in original] or ["torch_dtype"], "float32"
    )
    fp32 = tmp_path / "fp32"
    export.save_final_model(model, None, fp32, "5GB", dtype=export.export_dtype("auto", None, model))
    assert {t.dtype for t in folder_tensors(fp32).values()} == {torch.float32}
    assert json.loads((fp32 / "config.json").read_text()).get("torch_dtype", "float32") == "float32"
