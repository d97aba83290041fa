"""A model's transformers config and class, without building it (no layout code).

Both are read from ``model.config`` or a folder's config.json. The planner and the experts timing read shapes
through it at no cost; ``moeflow.loading.factory`` builds and loads with it. No layout code here, so what only
reads a model's shape does not rerun when the loading code changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moeflow.families import registry
from moeflow.model.folder import ModelError, check_model_folder
from moeflow.model.settings import ModelSettings


def causal_lm_class():
    """The transformers class every model is built and loaded with (``AutoModelForCausalLM``): the one place
    where the families it does not know are registered (moeflow.families)."""
    from transformers import AutoModelForCausalLM

    registry.register()
    return AutoModelForCausalLM


def build_config(fields: Mapping[str, Any], vocab_size: int | None = None):
    """A transformers config from a ``model.config`` mapping (``model_type`` plus the family's keys)."""
    from transformers import AutoConfig

    registry.register()
    fields = dict(fields)
    model_type = fields.pop("model_type")
    registry.require_stack(model_type)
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise ModelError(f"config key 'model.config.model_type': {exc}") from None


def transformers_config(settings: ModelSettings, folder: str | os.PathLike | None = None):
    """The transformers config of the model: ``folder``'s (or ``model.pretrained``'s) config.json, else
    :func:`build_config` of ``model.config``."""
    folder = folder or settings.pretrained
    if not folder:
        return build_config(settings.config)
    from transformers import AutoConfig

    registry.register()
    return AutoConfig.from_pretrained(
        check_model_folder(folder), trust_remote_code=settings.trust_remote_code, local_files_only=True
    )
