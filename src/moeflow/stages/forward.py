"""The forward-only stages' typed settings and the opening their scripts share.

Five stages run a model without training it (coverage_valset, esft_routing, evaluate_model, lm_eval_task,
humaneval_generate). Each script starts the same way::

    job = Job.from_argv(EvaluateModelStage)
    stage = Stage.start(job)
    layout = forward_layout(job, stage, job.input.base)   # the memory plan refuses here, before a load
    model = load_model(job, stage, layout, job.input.base)

The settings are what moeflow.workflow.rule_settings builds for the rule; their common part is
moeflow.workflow.keys.forward_settings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.loading.factory import Layout, make_model
from moeflow.model.device import compute_dtype
from moeflow.model.settings import ModelSettings
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.forward import refuse_unless_fits
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage


@dataclass(frozen=True)
class ForwardStage:
    """What every forward-only stage loads its model with: the model, the device, the stage's layout and the
    batch its memory plan counts (moeflow.workflow.keys.forward_batch)."""

    model: ModelSettings
    device: str
    parallel: ParallelSettings
    batch: dict[str, Any]


@dataclass(frozen=True)
class CoverageValsetStage(ForwardStage):
    """Rule coverage_valset: the coverage key's settings (moeflow.workflow.keys.coverage_settings)."""

    base: str
    data: str
    coverage: dict[str, Any]
    seed: int


@dataclass(frozen=True)
class EsftRoutingStage(ForwardStage):
    """Rule esft_routing (moeflow.workflow.keys.esft_routing_settings)."""

    base: str
    data: str
    finetune_corpus: str
    token_budget: int | None
    batch_tokens: int
    precision: str


@dataclass(frozen=True)
class EvaluateModelStage(ForwardStage):
    """Rule evaluate_model: ``evaluate`` holds how the sets are batched; ``coverage`` is the coverage settings of
    the run whose validation set it reads. Nothing names the run: runs that evaluate one base model alike share
    its job (common.smk's base_evaluation_run)."""

    evaluate: dict[str, Any]
    coverage: dict[str, Any]
    eval_corpora: tuple[str, ...]


@dataclass(frozen=True)
class LmEvalTaskStage(ForwardStage):
    """Rule lm_eval_task: one entry of ``evaluate.tasks`` (``task``) on the model labelled ``label``."""

    lm_eval: dict[str, Any]
    serving: dict[str, Any] | None  # with evaluate.lm_eval.engine vllm: serve.python, dtype, timeout_s
    task: str
    eval_corpora: tuple[str, ...]
    seq_len: int
    label: str


@dataclass(frozen=True)
class HumanEvalGenerateStage(ForwardStage):
    """Rule humaneval_generate: ``humaneval`` as moeflow.evaluation.humaneval.HumanEvalGeneration takes it."""

    humaneval: dict[str, Any]


def forward_layout(job: Job, stage: Stage, folder: str | os.PathLike) -> Layout:
    """The job's ranks joined in its layout, after its memory plan for the model at ``folder`` was checked
    against this rank's GPU (moeflow.plan.forward.refuse_unless_fits: refused before anything is loaded)."""
    settings = job.settings
    layout = Layout.join(settings.parallel, settings.device, None, stage.precision)
    refuse_unless_fits(settings.batch, job.params.settings["model"], folder, layout)
    return layout


def load_model(
    job: Job, stage: Stage, layout: Layout, folder: str | os.PathLike, data: Sequence[str | os.PathLike] = ()
) -> torch.nn.Module:
    """The model at ``folder`` for the job's layout, in the stage's compute dtype, with the rule's experts choice;
    ``data``: the shards it will read (their token ids are checked against its vocabulary)."""
    return make_model(
        job.settings.model,
        experts=job.input.experts,
        folder=folder,
        layout=layout,
        dtype=compute_dtype(stage.precision),
        data=list(data),
    )
