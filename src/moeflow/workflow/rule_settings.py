"""Each rule's settings: the one dict a job's script types, and the runs that serve a keyed stage.

A rule passes its script two params, ``settings`` (built here from the run config, everything the stage reads)
and ``runtime``; Snakemake's params trigger compares both, so a change to either reruns the rule. A stage that
runs through torchrun gets them on its command line as JSON (:class:`CommandLineJson`).

A stage whose output is named by a key (the warmup, the coverage set, the base model, ESFT's passes) serves
every run with that key; :func:`configs_by_key` refuses two runs that share a key but would give its job
different settings, naming both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from moeflow.evaluation.lm_eval_tasks import by_label as lm_eval_tasks
from moeflow.settings import ConfigError, differing_keys
from moeflow.workflow import keys


class CommandLineJson(dict):
    """A rule param that Snakemake's params trigger compares as a dict (by ``repr``) and that a shell command
    line formats as JSON (``{params.settings:q}``)."""

    def __str__(self) -> str:
        return json.dumps(self, sort_keys=True)


def evaluate_model_settings(cfg: Mapping[str, Any], coverage_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Rule evaluate_model (moeflow.stages.forward.EvaluateModelStage): how the sets are batched (not lm-eval's or
    HumanEval's keys), the coverage settings of the run whose validation set it reads, its corpora. No run name:
    runs that evaluate one base model alike share its job."""
    return keys.forward_settings(cfg, "evaluate_model") | {
        "evaluate": keys.eval_batch_settings(cfg),
        "coverage": coverage_cfg["coverage"],
        "eval_corpora": cfg["data"]["eval_corpora"],
    }


# What the validation set's coverage recheck counts against (moeflow.evaluation.comparison.coverage_recheck).
COVERAGE_RECHECK_KEYS = ("min_docs_per_expert", "min_tokens")


def evaluate_run_settings(cfg: Mapping[str, Any], coverage_cfg: Mapping[str, Any], run: str) -> dict[str, Any]:
    """Rule evaluate_run (moeflow.evaluation.comparison.EvaluateRunStage): the run, its fine-tuning corpus and the
    coverage thresholds of the run whose validation set its models were evaluated on."""
    return {
        "run": run,
        "finetune_corpus": cfg["data"]["finetune_corpus"],
        "coverage": {key: coverage_cfg["coverage"][key] for key in COVERAGE_RECHECK_KEYS},
    }


def lm_eval_task_settings(cfg: Mapping[str, Any], task: str, model: str) -> dict[str, Any]:
    """Rule lm_eval_task (moeflow.stages.forward.LmEvalTaskStage): the task of label ``task`` from
    ``evaluate.tasks``, on ``model`` (base or finetuned); the evaluation corpora when the task reads them; the
    serving environment's settings with the vllm engine."""
    spec = lm_eval_tasks(cfg["evaluate"]["tasks"])[task]
    return keys.forward_settings(cfg, "lm_eval_task") | {
        "lm_eval": cfg["evaluate"]["lm_eval"],
        "serving": keys.engine_serving(cfg, cfg["evaluate"]["lm_eval"]["engine"]),
        "task": spec.spec,
        "eval_corpora": cfg["data"]["eval_corpora"] if spec.docs else [],
        "seq_len": cfg["data"]["seq_len"],
        "label": model,
    }


def serve_check_settings(cfg: Mapping[str, Any], run: str) -> dict[str, Any]:
    """Rule serve_check (moeflow.serving.settings.ServeCheckStage): the run, how moeflow loads its model (the model
    section, the device) and the ``serve`` section."""
    return {"run": run, "model": keys.untrained_model(cfg), "device": cfg["hardware"]["device"], "serve": cfg["serve"]}


# Rule -> its settings from the run config it serves, for the rules whose wildcards name nothing else.
BY_CONFIG: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "pretrain_base": keys.base_model_settings,
    "plan_memory": keys.plan_settings,
    "coverage_valset": lambda cfg: keys.coverage_settings(cfg) | keys.forward_settings(cfg, "coverage_valset"),
    "esft_routing": lambda cfg: keys.esft_routing_settings(cfg) | keys.forward_settings(cfg, "esft_routing"),
    "esft_select": keys.esft_selection_settings,
    "warmup": keys.warmup_settings,
    "train_model": keys.train_model_settings,
    "humaneval_generate": lambda cfg: (
        keys.forward_settings(cfg, "humaneval_generate") | {"humaneval": keys.humaneval_generation_settings(cfg)}
    ),
    "humaneval_execute": lambda cfg: {
        "execution": keys.humaneval_execution_settings(cfg),
        "generation": keys.humaneval_generation_settings(cfg),
    },
}


def rule_settings(
    rule: str, cfg: Mapping[str, Any], wildcards: Mapping[str, str], coverage_cfg: Mapping[str, Any]
) -> dict[str, Any]:
    """``params.settings`` of a job of ``rule`` that serves the run config ``cfg``: ``wildcards`` are the job's,
    ``coverage_cfg`` the config of the run whose coverage validation set ``cfg`` uses."""
    if rule == "evaluate_model":
        return evaluate_model_settings(cfg, coverage_cfg)
    if rule == "evaluate_run":
        return evaluate_run_settings(cfg, coverage_cfg, wildcards["run"])
    if rule == "routing_drift":
        return {"run": wildcards["run"]}
    if rule == "serve_check":
        return serve_check_settings(cfg, wildcards["run"])
    if rule == "serving_adapter":
        return {"run": wildcards["run"]}
    if rule == "lm_eval_task":
        return lm_eval_task_settings(cfg, wildcards["task"], wildcards["model"])
    return BY_CONFIG[rule](cfg)


# The keyed stages: the wildcard naming a stage's output, its key function and the rules that read it.
KEYED_STAGES: dict[str, tuple[Callable[[Mapping[str, Any]], str], tuple[str, ...]]] = {
    "basekey": (keys.base_key, ("pretrain_base",)),
    "covkey": (keys.coverage_key, ("coverage_valset",)),
    "warmkey": (keys.warmup_key, ("warmup",)),
    "routkey": (keys.esft_routing_key, ("esft_routing",)),
    "selkey": (keys.esft_selection_key, ("esft_select",)),
}


def configs_by_key(wildcard: str, configs: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The run config each key of the stage named by ``wildcard`` serves, from ``configs`` (run name -> the
    config the stage reads for it). Two runs with one key must give the stage's rules the same settings (its layout
    included, which no key holds); otherwise a ConfigError names both runs and what differs. The runtime param is
    not compared: where a stage's numbers depend on the precision or seed, its key holds them."""
    key_of, rules = KEYED_STAGES[wildcard]
    served: dict[str, tuple[str, Mapping[str, Any], dict[str, Any]]] = {}
    for run, cfg in configs.items():
        key = key_of(cfg)
        view = {rule: BY_CONFIG[rule](cfg) for rule in rules}
        if key not in served:
            served[key] = (run, cfg, view)
            continue
        first, _, seen = served[key]
        if view != seen:
            differ = sorted(differing_keys(seen, view))
            raise ConfigError(
                f"runs {first!r} and {run!r} share rule {rules[0]}'s output {key} but differ in what it reads "
                f"({', '.join(differ)}): give them the same settings there (for a layout: coverage.strategy and "
                "coverage.ranks, or evaluate's), or change one so that its key differs"
            )
    return {key: cfg for key, (_, cfg, _) in served.items()}
