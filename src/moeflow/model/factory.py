"""Build a model from config or load a pretrained folder, the same way in every stage (``moeflow.checkpoint.export``
writes the final one)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from moeflow.model.chunked_loss import install as install_linear_loss
from moeflow.model.families import registry
from moeflow.model.folder import ModelError, _remote_code_error, check_model_folder
from moeflow.runtime import compat
from moeflow.runtime.files import read_json
from moeflow.settings import MODEL_SCHEMA, with_defaults

# ``model.experts_implementation`` that a stage resolves by measurement (:func:`resolve_experts`)
# before it builds or loads the model.
AUTO_EXPERTS = "auto"


# The experts implementation of a section that names none (tests and benchmarks give a few keys), and of a
# choice made for a model without experts: whatever the stack and the folder use by default.
STACK_DEFAULT_EXPERTS = None


def model_section(model_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``model`` section with the schema's defaults for the keys it leaves out (a stage gets the whole
    section; tests and benchmarks may give a few keys, or none to load a folder as it is). One that leaves
    out ``experts_implementation`` gets the stack's default rather than the config's ``auto``, which only a
    stage with the measured choice can resolve."""
    return with_defaults({"experts_implementation": STACK_DEFAULT_EXPERTS, **(model_cfg or {})}, MODEL_SCHEMA)


def resolve_experts(model_cfg: Mapping[str, Any], choice_file: str | os.PathLike) -> dict[str, Any]:
    """The ``model`` section as a stage builds or loads the model: ``experts_implementation`` from the choice
    file of rule choose_experts (moeflow.model.experts_choice), which the config's value must be the one chosen for."""
    choice = read_json(choice_file)
    if choice["configured"] != model_cfg["experts_implementation"]:
        raise ModelError(
            f"{choice_file} was chosen for model.experts_implementation {choice['configured']!r}, but this stage's "
            f"config has {model_cfg['experts_implementation']!r}: the rule's input 'experts' is another run's choice"
        )
    return {**model_cfg, "experts_implementation": choice["implementation"]}


def resolve_stage_experts(settings: Any, choice_file: str | os.PathLike) -> Any:
    """Typed stage settings (moeflow.config) with their ``model`` section :func:`resolve_experts`'d."""
    return dataclasses.replace(settings, model=resolve_experts(settings.model, choice_file))


def _impl_kwargs(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    model_cfg = model_section(model_cfg)
    kwargs: dict[str, Any] = {"attn_implementation": model_cfg["attn_implementation"]}
    experts = model_cfg["experts_implementation"]
    if experts == AUTO_EXPERTS:
        raise ModelError(
            "model.experts_implementation is 'auto', which is resolved by measurement, and no choice was given: "
            "the stage needs rule choose_experts's choice file (results/<stack>/experts/<key>/choice.json) as its "
            "input 'experts', applied with moeflow.model.factory.resolve_experts before the model is built or loaded "
            "(or set model.experts_implementation to eager, grouped_mm or batched_mm)"
        )
    if experts is STACK_DEFAULT_EXPERTS:
        return kwargs
    if not compat.is_transformers_v5():
        if experts != "eager":  # transformers 4.57 runs its experts in a per-expert loop, the only one it has
            compat.require_transformers_v5(f"model.experts_implementation: {experts}")
        return kwargs
    kwargs["experts_implementation"] = experts
    return kwargs


def with_chunked_loss(model, model_cfg: Mapping[str, Any]):
    """Every model moeflow builds or loads computes its loss by chunks (``moeflow.model.chunked_loss``) of
    ``model.loss_chunk_tokens`` tokens, never from the full logits."""
    return install_linear_loss(model, model_section(model_cfg)["loss_chunk_tokens"])


def build_config(model_cfg: Mapping[str, Any], vocab_size: int | None = None):
    """A transformers config from the ``model.config`` mapping (``model_type`` plus the family's keys)."""
    from transformers import AutoConfig

    registry.register()
    fields = dict(model_cfg["config"])
    model_type = fields.pop("model_type")
    registry.require_stack(model_type)
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise ModelError(f"config key 'model.config.model_type': {exc}") from None


def model_config(model_cfg: Mapping[str, Any]):
    """The transformers config of a ``model`` section: the pretrained folder's, or :func:`build_config`'s."""
    model_cfg = model_section(model_cfg)
    if not model_cfg["pretrained"]:
        return build_config(model_cfg)
    from transformers import AutoConfig

    registry.register()

    return AutoConfig.from_pretrained(
        check_model_folder(model_cfg["pretrained"]),
        trust_remote_code=model_cfg["trust_remote_code"],
        local_files_only=True,
    )


def build_model(model_cfg: Mapping[str, Any], vocab_size: int, seed: int = 0):
    """A freshly initialised causal LM from config (deterministic for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(model_cfg, vocab_size)
    torch.manual_seed(seed)
    kwargs = _impl_kwargs(model_cfg)
    return with_chunked_loss(AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **kwargs), model_cfg)


def load_model(path: str | os.PathLike, model_cfg: Mapping[str, Any] | None = None, dtype: Any = None):
    """Load a local pretrained folder with ``from_pretrained`` (never the hub: offline mode is set), from
    safetensors only, running the folder's own code only if ``model.trust_remote_code`` is on."""
    import torch
    from transformers import AutoModelForCausalLM

    registry.register()
    model_cfg = model_section(model_cfg)
    path = check_model_folder(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            torch_dtype=dtype or torch.float32,
            trust_remote_code=model_cfg["trust_remote_code"],
            local_files_only=True,
            use_safetensors=True,
            **_impl_kwargs(model_cfg),
        )
    except ValueError as exc:
        remote = _remote_code_error(path, exc)
        if remote is None:
            raise
        raise remote from None
    return with_chunked_loss(model, model_cfg)
