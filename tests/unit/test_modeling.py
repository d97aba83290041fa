"""moeflow.modeling: the experts implementation a model is built and loaded with."""

from __future__ import annotations

import pytest
from tiny_models import VOCAB, tiny_model_cfg

from moeflow.model.factory import build_model, load_model, resolve_experts, resolve_stage_experts
from moeflow.model.folder import ModelError
from moeflow.runtime import compat
from moeflow.runtime.files import write_json
from moeflow.settings import typed
from moeflow.train.settings import TrainModelStage
from moeflow.workflow.keys import training


def experts_of(model) -> str | None:
    return getattr(model.config, "_experts_implementation", None)


def choice_file(tmp_path, implementation, configured="auto"):
    path = tmp_path / "choice.json"
    write_json(path, {"configured": configured, "implementation": implementation, "shape": None})
    return path


def test_auto_without_the_choice_is_an_error_that_names_the_missing_input(tmp_path):
    auto = tiny_model_cfg() | {"experts_implementation": "auto"}
    with pytest.raises(ModelError, match=r"input 'experts'.*resolve_experts"):
        build_model(auto, VOCAB)
    build_model(tiny_model_cfg(), VOCAB).save_pretrained(tmp_path / "model")
    with pytest.raises(ModelError, match="choose_experts"):
        load_model(tmp_path / "model", auto)


def test_the_choice_resolves_auto_when_the_model_is_built_and_loaded(tmp_path):
    auto = tiny_model_cfg() | {"experts_implementation": "auto"}
    resolved = resolve_experts(auto, choice_file(tmp_path, "eager"))
    assert resolved == auto | {"experts_implementation": "eager"}
    model = build_model(resolved, VOCAB)
    assert experts_of(model) == ("eager" if compat.is_transformers_v5() else None)  # 4.57: only its loop
    model.save_pretrained(tmp_path / "model")
    assert experts_of(load_model(tmp_path / "model", resolved)) == experts_of(model)


def test_a_choice_made_for_another_setting_is_refused(tmp_path):
    with pytest.raises(ModelError, match="another run's choice"):
        resolve_experts(tiny_model_cfg() | {"experts_implementation": "eager"}, choice_file(tmp_path, "eager"))


def test_stage_settings_get_the_resolved_section(tmp_path):
    data = {
        "train": training({"steps": 4, "lr": 1e-3}),
        "model": tiny_model_cfg() | {"experts_implementation": "auto"},
        "warmup": "w-0",
        "parallel": {},
        "hardware_device": "cpu",
    }
    stage = resolve_stage_experts(typed(TrainModelStage, data), choice_file(tmp_path, "eager"))
    assert stage.model["experts_implementation"] == "eager" and stage.train == typed(TrainModelStage, data).train


def test_a_section_that_names_no_implementation_loads_with_the_stacks_default():
    cfg = {k: v for k, v in tiny_model_cfg().items() if k != "experts_implementation"}
    model = build_model(cfg, VOCAB)
    assert experts_of(model) == ("grouped_mm" if compat.is_transformers_v5() else None)


@pytest.mark.skipif(compat.is_transformers_v5(), reason="the pinned stack's per-expert loop")
def test_the_pinned_stack_takes_eager_as_its_loop_and_refuses_the_others():
    build_model(tiny_model_cfg() | {"experts_implementation": "eager"}, VOCAB)
    with pytest.raises(compat.UnsupportedOnStack, match="grouped_mm"):
        build_model(tiny_model_cfg() | {"experts_implementation": "grouped_mm"}, VOCAB)
