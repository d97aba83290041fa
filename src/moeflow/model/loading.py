"""Loading a model for training in a layout: the process group's ranks, the whole model or each rank's rows
on the meta device, sharded for ``parallel.strategy``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from moeflow.model.factory import _impl_kwargs, model_section, with_chunked_loss
from moeflow.model.factory import load_model as load_whole_model
from moeflow.model.families import registry
from moeflow.model.folder import check_model_folder, check_vocabulary
from moeflow.model.lora import prepare_model
from moeflow.parallel.layouts import distributed_config, shard_model
from moeflow.parallel.process_group import DistributedError, Ranks, check_ranks, init
from moeflow.parallel.rank_load import (
    build_on_meta,
    fill_from_folder,
    tied_names,
)
from moeflow.parallel.settings import ParallelSettings
from moeflow.train.settings import TrainSettings


def load_model(
    path: str | os.PathLike, model_cfg: Mapping[str, Any], parallel: ParallelSettings, precision: str, dtype: Any = None
):
    """Load a saved model folder for this layout: sharded by transformers at load time for ``ep``,
    whole (then :func:`shard_model`) otherwise. (``_from_config`` takes no DistributedConfig: an
    expert-parallel run needs a folder, such as the base model or a checkpoint's save_pretrained.)"""
    if parallel.strategy != "ep":
        return load_whole_model(path, model_cfg, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    registry.register()
    trust = model_section(model_cfg)["trust_remote_code"]
    if getattr(
        AutoConfig.from_pretrained(check_model_folder(path), trust_remote_code=trust, local_files_only=True),
        "tie_word_embeddings",
        False,
    ):
        # Measured on transformers 5.24 (tests/test_train_distributed.py): the first step's gradients are
        # right, but the output layer and the embedding then train apart (loss 5e-4 off one process's at step 2).
        raise DistributedError(
            f"parallel.strategy: ep with a model whose embedding and output layer are tied (tie_word_embeddings in "
            f"{path}/config.json): transformers 5's expert-parallel sharding unties them during training. Use "
            "parallel.strategy: fsdp for this model, or a model with tie_word_embeddings: false (model.config)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        check_model_folder(path),
        use_safetensors=True,
        torch_dtype=dtype or torch.float32,
        trust_remote_code=trust,
        local_files_only=True,
        distributed_config=distributed_config(parallel, precision),
        **_impl_kwargs(model_cfg),
    )
    return with_chunked_loss(model, model_cfg)


def start_fine_tuning(job: Any, precision: str, weights: bool = True) -> tuple[Ranks, torch.nn.Module]:
    """What the warmup and train_model stages do first: start this rank's process group, check the ranks
    against the run's layout, and load the base model (``job.input.model``) for it, checked against the
    fine-tuning data's vocabulary (``job.input.data``). ``job``: ``stage.job_from_argv``'s, with settings.
    ``weights``: as :func:`load_for_training` takes it (False: a checkpoint will replace every weight)."""
    settings = job.settings
    ranks = init(settings.hardware_device)
    parallel = check_ranks(settings.parallel, ranks)
    model = load_for_training(
        job.input.model,
        settings.model,
        settings.train,
        parallel,
        ranks,
        job.input.data,
        precision=precision,
        weights=weights,
    )
    return ranks, model


def load_for_training(
    path: str | os.PathLike,
    model_cfg: Mapping[str, Any],
    train: TrainSettings,
    parallel: ParallelSettings,
    ranks: Ranks,
    data: str | os.PathLike | None = None,
    *,
    precision: str,
    weights: bool = True,
) -> torch.nn.Module:
    """A saved model folder, ready for the Trainer: loaded for the layout, checked against the vocabulary
    ``data`` (a tokenized split folder) was tokenized with (``moeflow.model.folder.check_vocabulary``), with
    LoRA adapters for ``train.method: lora`` (``moeflow.model.lora.prepare_model``), then sharded
    (:func:`shard_model`, in ``precision``: before the optimizer is built). LoRA runs on several ranks
    with ``parallel.strategy: none`` only.

    ``fsdp`` (full fine-tuning, any number of ranks): built with parameters on the meta device, sharded,
    and each rank's shards read from the folder's safetensors files (``moeflow.parallel.rank_load``): no rank
    holds what it does not own, and one rank holds the weights once (transformers 5's ``from_pretrained``
    keeps the files mapped beside the tensors it copies: ~1.3x the weights resident at one rank).
    ``none``, ``ep``, LoRA: :func:`load_model`. ``weights=False`` (the caller loads a checkpoint that
    replaces every parameter and persistent buffer): a full fine-tuning model gets uninitialised
    parameters, no weight is read (``ep`` and LoRA still load the folder: transformers shards ``ep`` at
    load, and peft wraps a loaded base model; the checkpoint then overwrites every parameter anyway)."""
    if train.method == "lora" and parallel.strategy != "none" and ranks.world_size > 1:
        raise DistributedError(
            f"config keys 'train.method': lora and 'parallel.strategy': {parallel.strategy} do not combine: "
            "LoRA adapters are "
            "not sharded here (peft over FSDP or expert parallelism is not built). "
            "Use parallel.strategy: none (every rank "
            "holds the frozen base model and the adapters; "
            "the adapters' gradients are summed over ranks), or train.method: full"
        )
    full = train.method == "full"
    on_meta = full and (parallel.strategy == "fsdp" or (parallel.strategy == "none" and not weights))
    model = build_on_meta(path, model_cfg) if on_meta else load_model(path, model_cfg, parallel, precision)
    if data is not None:
        check_vocabulary(model, [data], path)
    names_of = tied_names(model)
    model = shard_model(prepare_model(model, train), parallel, ranks, precision)
    if on_meta and weights:
        fill_from_folder(model, path, names_of)
    return model
