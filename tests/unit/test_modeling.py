"""moeflow.loading.factory.make_model, the one door to a model: the experts implementation it builds and loads
with (the rule's choice for ``auto``), the chunked loss on every model it returns, the layouts it prepares
(one process on a device, LoRA adapters), and the combinations it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import VOCAB, folder_settings, tiny_model_cfg

from moeflow.loading.factory import Layout, make_model, resolve_experts
from moeflow.model.chunked_loss import installed
from moeflow.model.folder import ModelError
from moeflow.model.lora import is_lora_model
from moeflow.model.settings import STACK_DEFAULT_EXPERTS, ModelSettings
from moeflow.parallel.process_group import DistributedError, Ranks
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.runtime.files import write_json
from moeflow.settings import typed
from moeflow.train.settings import TrainSettings
from moeflow.workflow.keys import training


def settings(**keys) -> ModelSettings:
    return typed(ModelSettings, tiny_model_cfg() | keys)


def experts_of(model) -> str | None:
    return getattr(model.config, "_experts_implementation", None)


def choice_file(tmp_path, implementation, configured="auto"):
    path = tmp_path / "choice.json"
    write_json(path, {"configured": configured, "implementation": implementation, "shape": None})
    return path


def test_the_schema_default_is_auto_and_without_the_choice_an_error_that_names_the_missing_input(tmp_path):
    auto = typed(ModelSettings, {k: v for k, v in tiny_model_cfg().items() if k != "experts_implementation"})
    assert auto.experts_implementation == "auto" and auto.loss_chunk_tokens == 1024  # config/schema.yaml's
    with pytest.raises(ModelError, match=r"input 'experts'.*make_model"):
        make_model(auto, vocab_size=VOCAB)
    make_model(settings(), vocab_size=VOCAB).save_pretrained(tmp_path / "model")
    with pytest.raises(ModelError, match="choose_experts"):
        make_model(auto, folder=tmp_path / "model")


def test_the_choice_resolves_auto_when_the_model_is_built_and_loaded(tmp_path):
    auto = settings(experts_implementation="auto")
    choice = choice_file(tmp_path, "eager")
    assert resolve_experts(auto, choice) == dataclasses.replace(auto, experts_implementation="eager")
    model = make_model(auto, experts=choice, vocab_size=VOCAB)
    assert experts_of(model) == ("eager" if compat.is_transformers_v5() else None)  # 4.57: only its loop
    model.save_pretrained(tmp_path / "model")
    assert experts_of(make_model(auto, experts=choice, folder=tmp_path / "model")) == experts_of(model)


def test_a_choice_made_for_another_setting_is_refused(tmp_path):
    with pytest.raises(ModelError, match="another run's choice"):
        make_model(settings(experts_implementation="eager"), experts=choice_file(tmp_path, "eager"), vocab_size=VOCAB)


def test_the_stacks_default_is_what_from_pretrained_uses():
    model = make_model(settings(experts_implementation=STACK_DEFAULT_EXPERTS), vocab_size=VOCAB)
    assert experts_of(model) == ("grouped_mm" if compat.is_transformers_v5() else None)


@pytest.mark.skipif(compat.is_transformers_v5(), reason="the pinned stack's per-expert loop")
def test_the_pinned_stack_takes_eager_as_its_loop_and_refuses_the_others():
    make_model(settings(experts_implementation="eager"), vocab_size=VOCAB)
    with pytest.raises(compat.UnsupportedOnStack, match="grouped_mm"):
        make_model(settings(experts_implementation="grouped_mm"), vocab_size=VOCAB)


def test_a_build_is_seeded_and_every_model_gets_the_chunked_loss_of_its_settings(tmp_path):
    model = make_model(settings(loss_chunk_tokens=7), vocab_size=VOCAB, seed=3)
    again = make_model(settings(loss_chunk_tokens=7), vocab_size=VOCAB, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert installed(model) and model.loss_chunk_tokens == 7
    model.save_pretrained(tmp_path / "model")
    loaded = make_model(folder_settings(loss_chunk_tokens=5), folder=tmp_path / "model")
    assert installed(loaded) and loaded.loss_chunk_tokens == 5
    lora = _train("lora")
    adapted = make_model(settings(), folder=tmp_path / "model", layout=Layout.single("cpu", lora))
    assert is_lora_model(adapted) and installed(adapted)
    assert sorted(adapted.merge_and_unload().state_dict()) == sorted(loaded.state_dict())


def test_a_model_loads_in_the_dtype_and_on_the_device_asked_for(tmp_path):
    make_model(settings(), vocab_size=VOCAB).save_pretrained(tmp_path / "model")
    model = make_model(settings(), folder=tmp_path / "model", device="meta", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def test_data_tokenized_with_a_larger_vocabulary_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_json(data / "manifest.json", {"tokenizer": {"vocab_size": VOCAB + 1}})
    with pytest.raises(ModelError, match="tokenizer/model mismatch"):
        make_model(settings(), vocab_size=VOCAB, data=[data])
    make_model(settings(), vocab_size=VOCAB + 1, data=[data])


def _train(method: str, **lora) -> TrainSettings:
    section = {"steps": 1, "lr": 1e-3, "method": method} | ({"lora": {"rank": 2, **lora}} if method == "lora" else {})
    return typed(TrainSettings, training(section))


def test_the_combinations_it_refuses_name_the_keys(tmp_path):
    two = Ranks(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    fsdp = typed(ParallelSettings, {"strategy": "fsdp", "nproc_per_node": 2})
    ep = typed(ParallelSettings, {"strategy": "ep", "ep_size": 2, "nproc_per_node": 2})
    with pytest.raises(DistributedError, match="'train.lora.router': adapter and 'parallel.strategy': ep"):
        make_model(settings(), vocab_size=VOCAB, layout=Layout(two, ep, _train("lora", router="adapter")))
    with pytest.raises(DistributedError, match=r"'train.lora.targets': \[routed_experts\] and 'parallel.strategy': ep"):
        make_model(settings(), vocab_size=VOCAB, layout=Layout(two, ep, _train("lora", targets=["routed_experts"])))
    if not compat.fsdp2_available():  # FSDP1's flat parameters hold one dtype
        with pytest.raises(DistributedError, match="'train.method': lora and 'parallel.strategy': fsdp.*STACK=current"):
            make_model(settings(), vocab_size=VOCAB, layout=Layout(two, fsdp, _train("lora")))
    with pytest.raises(DistributedError, match="ep loads a saved model folder"):
        make_model(settings(), vocab_size=VOCAB, layout=Layout(two, ep, _train("full")))
    with pytest.raises(ValueError, match="a layout or a device"):
        make_model(settings(), vocab_size=VOCAB, layout=Layout.single("cpu"), device="cpu")
