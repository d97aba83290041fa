"""Load, merge, validate and hash the configuration; list the runs; the stages' typed settings.

The configuration is one YAML tree (``config/config.yaml`` plus any overlays, merged by
:func:`deep_merge`'s rules). ``config/schema.yaml`` is the only place a default or an allowed value is
written: :func:`with_defaults` fills the defaults in once the overlays are merged, for the base config
and for each run. A *run* is a named overlay of that tree (``runs: {dense: {model: ...}}``); every run's
merged config is validated on its own. Stage outputs are keyed by a hash of exactly the settings that
stage depends on, so two runs that agree on, say, the data settings share the data stages. Those
settings are plain data (a rule's ``params``); :func:`settings` turns them into the frozen dataclasses
below that the library takes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import yaml

from .harness_tasks import task_problems

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"
SOURCE_SCHEMA = "#/$defs/source"  # a data source, in config/schema.yaml
MODEL_SCHEMA = "#/properties/model"
PRECISIONS = "#/properties/precision"
BAD_RECORD_POLICIES = "#/properties/data/properties/on_bad_record"
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


# --------------------------------------------------------------------------- loading and merging


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``base`` with ``overlay`` merged in, as every overlay applies (a config file, ``overrides``, a run):
    mappings merge key by key; ``null`` removes the key (``runs: {dense: null}`` drops the run); a data
    source whose ``type`` changes is replaced whole; any other value, lists included, replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        below = out.get(key)
        if value is None:
            out.pop(key, None)
        elif (
            isinstance(value, Mapping)
            and isinstance(below, Mapping)
            and not _replaces_source(path + (key,), below, value)
        ):
            out[key] = deep_merge(below, value, path + (key,))
        else:
            out[key] = deep_merge({}, value, path + (key,)) if isinstance(value, Mapping) else copy.deepcopy(value)
    return out


def _replaces_source(path: tuple[str, ...], below: Mapping[str, Any], value: Mapping[str, Any]) -> bool:
    """A data source of another ``type``: the keys of the old kind must not survive (``packages`` of a
    stdlib source under a jsonl one)."""
    return path[:2] == ("data", "sources") and len(path) == 3 and "type" in value and value["type"] != below.get("type")


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def load(*paths: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read the default config, merge the given overlay files and overrides (in order), fill in the
    schema's defaults and validate the result (see :func:`merged`)."""
    cfg = merged(read_yaml(DEFAULT_CONFIG), [read_yaml(path) for path in paths] + ([overrides] if overrides else []))
    validate(cfg)
    return cfg


# config/config.yaml's overlay for a model built from config (model.pretrained null), such as the embedded
# default's dense comparison run: a pretrained folder gets only the runs its own config names.
MODEL_FROM_CONFIG = "model_from_config"


def merged(default: Mapping[str, Any], overlays: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The default config with the overlays merged over it, the schema's defaults filled in. The
    ``model_from_config`` overlay (the default's, with what the overlays add to it) goes right over the
    default, under the overlays, when the result builds its model from config; it is dropped otherwise."""
    layers = [default, *overlays]
    from_config = functools.reduce(deep_merge, [layer.get(MODEL_FROM_CONFIG) or {} for layer in layers], {})
    base, *overlays = [{k: v for k, v in layer.items() if k != MODEL_FROM_CONFIG} for layer in layers]
    cfg = functools.reduce(deep_merge, overlays, base)
    if not (with_defaults(cfg).get("model") or {}).get("pretrained"):
        cfg = functools.reduce(deep_merge, overlays, deep_merge(base, from_config))
    return with_precision(with_defaults(cfg))


# ``precision: auto`` by ``hardware.device``: fp32 on the CPU (bf16 autocast measured 0.66x/0.86x fp32's speed
# on this 2-core machine: config/config.yaml), bf16 on CUDA (tensor cores: ~989 vs ~67 TFLOP/s on an H100).
AUTO_PRECISION = {"cpu": "fp32", "cuda": "bf16"}


def resolved_precision(cfg: Mapping[str, Any]) -> str:
    """The precision a config computes in: ``precision``, with ``auto`` made fp32 or bf16 by ``hardware.device``."""
    precision = cfg.get("precision", "auto")
    return AUTO_PRECISION[(cfg.get("hardware") or {}).get("device", "cpu")] if precision == "auto" else precision


def with_precision(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``precision: auto`` resolved, once, where the merged config (or a run's) is made: every
    stage key, rule and stage then sees fp32 or bf16. (A run that changes ``hardware.device`` over a base
    whose ``auto`` was already resolved sets its own ``precision``.)"""
    return {**cfg, "precision": resolved_precision(cfg)}


# --------------------------------------------------------------------------- the schema and its defaults


@functools.cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def schema_node(pointer: str = "#") -> dict[str, Any]:
    """The schema at a JSON pointer such as ``#/$defs/training``, its ``$ref`` followed."""
    node: Any = schema()
    for part in pointer.lstrip("#").strip("/").split("/") if pointer.strip("#/") else []:
        node = node[part]
    return _resolved(node)


def _resolved(node: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with its ``$ref`` (within this schema) replaced by the target; keys beside the ``$ref``
    (a ``default``, a ``description``) win."""
    if "$ref" not in node:
        return dict(node)
    target = schema_node(node["$ref"])
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _matches(subschema: Mapping[str, Any], instance: Any) -> bool:
    return jsonschema.validators.validator_for(schema())(subschema).is_valid(instance)


def with_defaults(tree: Any, node: Mapping[str, Any] | str = "#") -> Any:
    """``tree`` with every key the schema gives a ``default`` and the tree leaves out filled in, at every
    depth (through ``$ref`` and per data source, by its kind: ``if``/``then``/``else``). Keys present
    (``null`` included) are kept. The schema is the only place a default is written."""
    node = schema_node(node) if isinstance(node, str) else _resolved(node)
    if not isinstance(tree, Mapping):
        return copy.deepcopy(tree)
    out = dict(tree)
    branches = [node]
    if "if" in node:
        branches.append(node.get("then" if _matches(node["if"], out) else "else") or {})
    for branch in branches:
        for key, sub in (branch.get("properties") or {}).items():
            sub = _resolved(sub)
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
    properties = node.get("properties") or {}
    others = node.get("additionalProperties")
    for key, value in out.items():
        sub = properties.get(key, others if isinstance(others, Mapping) else None)
        if sub is not None and isinstance(value, Mapping):
            out[key] = with_defaults(value, sub)
    if properties and not isinstance(others, Mapping):
        # A record of named keys: in key order, so that the same settings are the same rule params (Snakemake
        # compares them in order) whether a key came from config.yaml, an overlay or the schema's default.
        # Maps of named entries (data.sources, runs) keep their order: it is meaningful.
        out = dict(sorted(out.items()))
    return out


def enum(pointer: str) -> tuple[Any, ...]:
    """The allowed values the schema lists at ``pointer`` (an enumeration is written only there)."""
    node = schema_node(pointer)
    return tuple(node["enum"] if "enum" in node else _resolved(node["items"])["enum"])


# --------------------------------------------------------------------------- validation


def _key_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _describe(error: Any) -> str:
    where = _key_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        return (
            f"config key '{where}': unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed keys are: {', '.join(allowed)}"
        )
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in error.validator_value)
        return f"config key '{where}': {error.instance!r} is not one of the allowed values ({allowed})"
    return f"config key '{where}': {error.message}"


def validate(cfg: Mapping[str, Any]) -> None:
    """Validate the base config and every run's merged config (the schema's defaults filled in); raise
    ConfigError naming each bad key."""
    check(with_defaults(cfg))
    for problem in run_problems(cfg):
        raise ConfigError(f"invalid configuration: {problem}")
    for name in cfg.get("runs", {}):
        check({**run_config(cfg, name, validated=False), "runs": {}}, f" (run '{name}')")


def check(tree: Mapping[str, Any], label: str = "") -> None:
    """Validate one config tree (the base, or a run's merged config) against the schema and the checks it
    cannot express."""
    for problem in copied_recipe_problems(tree):  # before the schema, whose message would be vaguer
        raise ConfigError(f"invalid configuration{label}: {problem}")
    validator = jsonschema.validators.validator_for(schema())(schema())
    errors = sorted(validator.iter_errors(tree), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = "\n".join(f"  - {_describe(e)}" for e in errors)
        raise ConfigError(f"invalid configuration{label}:\n{lines}\n(schema: {SCHEMA_PATH.relative_to(REPO_ROOT)})")
    for problem in semantic_problems(tree):
        raise ConfigError(f"invalid configuration{label}: {problem}")


def semantic_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Checks a schema cannot express. Each message names the key(s) and what to do."""
    problems: list[str] = []
    data = cfg.get("data", {})
    split = data.get("split", {})
    if split and split.get("heldout", 0) + split.get("test", 0) >= 1:
        problems.append("config keys 'data.split.heldout' + 'data.split.test' must sum to less than 1")
    for corpus, source in data.get("sources", {}).items():  # a corpus name is a folder under results/: no '/', no '..'
        if not RUN_NAME.match(str(corpus)):
            problems.append(
                f"config key 'data.sources.{corpus}': corpus names may use letters, digits, '_', '.', '-' only "
                "(the name is a folder under results/)"
            )
        misplaced = sorted(set(source) - source_keys(source["type"]))
        if misplaced:
            problems.append(
                f"config key 'data.sources.{corpus}': {', '.join(misplaced)} do not apply to a source of type "
                f"{source['type']}; remove them"
            )
    model = cfg.get("model") or {}
    if model.get("trust_remote_code") and not model.get("pretrained"):
        problems.append(
            "config key 'model.trust_remote_code' is on but 'model.pretrained' is not set: it may only be "
            "turned on for a named model folder whose code you trust"
        )
    if model.get("pretrained") and not Path(model["pretrained"]).is_dir():
        problems.append(pretrained_folder_problem(model["pretrained"]))
    elif model.get("pretrained") and not model.get("trust_remote_code"):
        problems += model_type_problems(Path(model["pretrained"]))
    if (cfg.get("pretrain") or {}).get("method", "full") != "full":
        problems.append("config key 'pretrain.method': pretraining trains the whole base model; use method: full")
    named = data.get("eval_corpora", []) + cfg.get("coverage", {}).get("pool_corpora", [])
    for corpus in named + [data.get("base_corpus"), data.get("finetune_corpus")]:
        if corpus is not None and corpus not in data.get("sources", {}):
            problems.append(
                f"config key 'data': corpus {corpus!r} is not among 'data.sources' "
                f"({', '.join(sorted(data.get('sources', {})))})"
            )
    for section in ("train", "pretrain"):
        train = cfg.get(section) or {}
        if train.get("warmup_steps") is not None and train.get("warmup_ratio") is not None:
            problems.append(
                f"config keys '{section}.warmup_steps' and '{section}.warmup_ratio' are both set; give one of them "
                "(set the other to null), e.g. warmup_steps: 1000 or warmup_ratio: 0.1"
            )
        if train.get("warmup_steps") and train.get("steps") and train["warmup_steps"] >= train["steps"]:
            problems.append(
                f"config key '{section}.warmup_steps' ({train['warmup_steps']}) "
                f"must be less than '{section}.steps' ({train['steps']})"
            )
        if train.get("min_lr") is not None and train.get("lr") is not None and train["min_lr"] > train["lr"]:
            problems.append(
                f"config key '{section}.min_lr' ({train['min_lr']}) must not exceed '{section}.lr' ({train['lr']})"
            )
    problems += parallel_problems(cfg)
    problems += attention_problems(cfg)
    problems += humaneval_problems(cfg)
    problems += lm_eval_problems(cfg)
    return problems


def lm_eval_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Every evaluate.tasks entry must resolve (moeflow.harness_tasks); moeflow_perplexity's documents are
    segments of up to data.seq_len tokens, each scored in one window of evaluate.lm_eval.max_length."""
    evaluate = cfg.get("evaluate") or {}
    tasks = evaluate.get("tasks") or []
    data = cfg.get("data") or {}
    problems = task_problems(tasks, data.get("eval_corpora") or [])
    max_length = (evaluate.get("lm_eval") or {}).get("max_length")
    seq_len = data.get("seq_len")
    if "moeflow_perplexity" in tasks and max_length is not None and seq_len is not None and max_length < seq_len:
        problems.append(
            f"config key 'evaluate.lm_eval.max_length' ({max_length}) is below 'data.seq_len' ({seq_len}): "
            "moeflow_perplexity scores each packed segment in one window; raise it or set null"
        )
    return problems


def humaneval_problems(cfg: Mapping[str, Any]) -> list[str]:
    """pass@k estimates from n samples per problem exist for k <= n only."""
    humaneval = (cfg.get("evaluate") or {}).get("humaneval") or {}
    n = humaneval.get("n_samples", 1)
    return [
        f"config key 'evaluate.humaneval.k[{i}]' ({k}) exceeds 'evaluate.humaneval.n_samples' ({n}): pass@k needs at "
        "least k sampled completions per problem; raise n_samples or drop that k"
        for i, k in enumerate(humaneval.get("k", []))
        if k > n
    ]


def attention_problems(cfg: Mapping[str, Any]) -> list[str]:
    """flash-attn refuses fp32 inputs (it would fail at the first forward): flash_attention_2 needs bf16."""
    model = cfg.get("model") or {}
    if model.get("attn_implementation") != "flash_attention_2" or resolved_precision(cfg) != "fp32":
        return []
    return [
        "config keys 'model.attn_implementation': flash_attention_2 and 'precision': fp32 do not combine: flash-attn "
        "runs in fp16/bf16 only and refuses fp32 inputs. Set precision: bf16 (or auto with hardware.device: cuda), "
        "or model.attn_implementation: sdpa"
    ]


def source_keys(kind: str) -> set[str]:
    """The keys a data source of ``kind`` takes: those of its branch of the schema's source
    (``if``/``then``/``else``)."""
    node = schema_node(SOURCE_SCHEMA)
    branch = node["then"] if _matches(node["if"], {"type": kind}) else node["else"]
    return {"type", *branch.get("required", []), *branch.get("properties", {})}


def pretrained_folder_problem(pretrained: str) -> str:
    folder = f"models/{Path(pretrained).name.lower()}"
    return (
        f"config key 'model.pretrained': {pretrained!r} is not a local model folder "
        f"(relative to {os.getcwd()}). moeflow "
        f"never downloads a model: fetch it first, e.g. `huggingface-cli download {pretrained} --local-dir {folder}`, "
        f"then set model.pretrained: {folder}"
    )


def model_type_problems(folder: Path) -> list[str]:
    """A pretrained folder whose config.json names a model type this stack's transformers cannot load as a
    causal LM: refused before any job runs (a folder with its own code is checked when it loads)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return []  # moeflow.modeling names what the folder lacks when a stage loads it
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return []
    # transformers' model tables, imported only for a pretrained folder (they import torch: seconds at DAG build)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = f"config key 'model.pretrained': {folder}/config.json names model_type {model_type!r}"
    if model_type not in CONFIG_MAPPING_NAMES:
        return [
            f"{where}, which transformers {transformers.__version__} does not have: a model this new needs "
            "transformers 5 (the 'current' stack, STACK=current) or a newer release"
        ]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [
            f"{where}: transformers {transformers.__version__} has its config but no causal-LM class for it "
            "(AutoModelForCausalLM cannot load it), and moeflow fine-tunes causal language models only"
        ]
    return []


def run_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Checks of the runs table against the base config: names, what a run may change, the paper's runs."""
    problems = []
    runs = cfg.get("runs") or {}
    for name, overlay in runs.items():
        if not RUN_NAME.match(name):
            problems.append(f"config key 'runs.{name}': run names may use letters, digits, '_', '.', '-' only")
            continue
        changes_model = "config" in ((overlay or {}).get("model") or {})
        if changes_model and run_config(cfg, name, validated=False)["model"]["pretrained"]:
            problems.append(
                f"config key 'runs.{name}.model.config': run {name!r} changes model.config, "
                "but model.pretrained is set: "
                "the pretrained folder's config.json is the model. Give the run its own model.pretrained folder, or "
                f"drop it (runs: {{{name}: null}})"
            )
    paper = cfg.get("paper") or {}
    for name in [paper.get("moe_run"), *paper.get("dense_runs", [])]:
        if name is not None and name not in runs:
            problems.append(
                f"config keys 'paper.moe_run' / 'paper.dense_runs': {name!r} is not a run ({', '.join(runs)})"
            )
    return problems


# --------------------------------------------------------------------------- scaling out (parallel:)


def parallel_problems(cfg: Mapping[str, Any]) -> list[str]:
    """The ``parallel`` layout must add up: world = nproc_per_node x nnodes = hardware.num_devices, and
    the FSDP and expert-parallel sizes must tile it the way transformers' DistributedConfig requires."""
    par = cfg.get("parallel")
    if not par:
        return []
    world = par.get("nproc_per_node", 1) * par.get("nnodes", 1)
    strategy, ep, fsdp = par.get("strategy", "none"), par.get("ep_size", 1), par.get("fsdp_size")
    problems = []
    devices = (cfg.get("hardware") or {}).get("num_devices")
    if devices is not None and world > 1 and devices != world:
        problems.append(
            f"config keys 'parallel.nproc_per_node' x 'parallel.nnodes' ({world} ranks) and 'hardware.num_devices' "
            f"({devices}) must agree: the memory planner plans for hardware.num_devices"
        )
    if (strategy == "ep") != (ep > 1):
        problems.append(
            f"config keys 'parallel.strategy' ({strategy!r}) and 'parallel.ep_size' ({ep}): expert parallelism is "
            "strategy: ep with ep_size > 1 (and ep_size: 1 otherwise)"
        )
    if fsdp is not None and (world % fsdp or fsdp > world):
        problems.append(f"config key 'parallel.fsdp_size' ({fsdp}) must divide the {world} ranks (null: all of them)")
    if ep > 1 and (fsdp or world) % ep:
        problems.append(
            f"config key 'parallel.ep_size' ({ep}) must divide parallel.fsdp_size ({fsdp or world}): transformers' "
            "DistributedConfig lays the expert-parallel groups over the FSDP ranks"
        )
    if fsdp is not None and fsdp > 1 and strategy == "none":
        problems.append(
            "config key 'parallel.fsdp_size' is set but parallel.strategy is 'none': use strategy: fsdp or ep"
        )
    return problems


def recipe_flag_advice(flag: str, value: Any) -> str | None:
    """What a flag of the copied recipe's expert-parallel launch (``torchrun ... --moe_expert_parallel_degree 2
    --moe_token_dispatcher_type balance --moe_eval_capacity_factor 1.2``, ``group_experts_by: device``)
    becomes in moeflow, or why it is refused; None for any other key. None of these flags exists in
    transformers or accelerate."""
    name = flag.lstrip("-").lower().replace("-", "_")
    text = str(value).lower().replace("-", "").replace("_", "")
    if name == "moe_expert_parallel_degree":
        return (
            f"'{flag}' is not a transformers flag; "
            "expert parallelism is transformers 5's DistributedConfig(ep_size=...): "
            f"use parallel: {{strategy: ep, ep_size: {value}}} (transformers 5 / STACK=current only)"
        )
    if name == "moe_token_dispatcher_type":
        if text in ("alltoall", "alltoallseq"):
            return f"'{flag}: {value}' is parallel.ep_implementation: all_to_all (transformers 5's token exchange)"
        if text == "allgather":
            return (
                f"'{flag}: {value}' is parallel.ep_implementation: all_reduce (every rank runs its experts on the "
                "shared batch and the outputs are summed; transformers allows it only when ep_size equals tp_size)"
            )
        return (
            f"'{flag}: {value}' is refused: transformers' expert parallelism dispatches tokens with all_to_all or "
            "all_reduce (parallel.ep_implementation), and no dispatcher balances load; load balancing is the "
            "global-batch balancing loss (train.balance)"
        )
    if name == "moe_eval_capacity_factor":
        return (
            f"'{flag}' is refused: transformers' MoE layers are dropless (every token reaches its top-k experts, "
            "in training and evaluation), so there is no capacity to set: remove it"
        )
    if name == "group_experts_by":
        if text == "device":
            return (
                f"'{flag}: {value}' is what expert parallelism does: use parallel: {{strategy: ep, ep_size: N}} "
                "(transformers 5 places num_experts / N experts on each device)"
            )
        return (
            f"'{flag}: {value}' is refused: experts are grouped by device under expert parallelism "
            "(parallel.ep_size), nothing else"
        )
    return None


def translate_recipe_flags(flags: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The copied recipe's expert-parallel flags as moeflow config overrides (the ``parallel`` section), and
    the refusals (with the reason) for flags that have no equivalent."""
    parallel: dict[str, Any] = {}
    refused: list[str] = []
    for flag, value in flags.items():
        name = flag.lstrip("-").lower().replace("-", "_")
        text = str(value).lower().replace("-", "").replace("_", "")
        if name == "moe_expert_parallel_degree":
            if int(value) > 1:
                parallel |= {"strategy": "ep", "ep_size": int(value)}
        elif name == "moe_token_dispatcher_type" and text in ("alltoall", "alltoallseq", "allgather"):
            parallel["ep_implementation"] = "all_reduce" if text == "allgather" else "all_to_all"
        elif name == "group_experts_by" and text == "device":
            parallel.setdefault("strategy", "ep")
        else:
            refused.append(recipe_flag_advice(flag, value) or f"'{flag}' is not a moeflow or transformers setting")
    return ({"parallel": parallel} if parallel else {}), refused


# Names from a widely copied MoE fine-tuning recipe that exist in neither transformers nor accelerate.
COPIED_RECIPE_NAMES = {
    "adamw_moe": "there is no optimizer 'adamw_moe'; use train.optimizer: adamw (AdamW with parameter groups: "
    "train.router_lr_multiplier, train.freeze_router, no weight decay on norms and biases)",
    "datacollatorformoe": "there is no 'DataCollatorForMoE'; moeflow packs documents with per-document attention "
    "(moeflow.collate), with no padding to max_length: remove the setting",
    "accumulate_gradient": "'Trainer.accumulate_gradient' does not exist; set train.grad_accum_steps (losses are "
    "normalised over the whole step) and train.balance.mode for the balancing loss across micro-batches",
    "global_batch_size": "there is no global batch size to set (so no micro-batch that fails to divide it): the "
    "global batch is train.micro_batch_size x train.grad_accum_steps x the ranks (parallel.nproc_per_node x "
    "parallel.nnodes); set those",
    "cosine_with_warmup": "there is no scheduler 'cosine_with_warmup' to choose: moeflow always warms up linearly "
    "(train.warmup_steps or train.warmup_ratio) and then decays with a cosine to train.min_lr",
}


def copied_recipe_problems(cfg: Any, path: str = "") -> list[str]:
    """Keys or values anywhere in the config that name things the copied recipe invented."""
    problems: list[str] = []
    items = cfg.items() if isinstance(cfg, Mapping) else enumerate(cfg) if isinstance(cfg, list) else []
    for key, value in items:
        where = (
            f"{path}.{key}"
            if path and not isinstance(key, int)
            else f"{path}[{key}]"
            if isinstance(key, int)
            else str(key)
        )
        advice = recipe_flag_advice(key, value) if isinstance(key, str) else None
        if advice:  # the recipe's expert-parallel flags: the real setting, or why there is none
            problems.append(f"config key '{where}': {advice}")
            continue
        for name in (key, value):
            if isinstance(name, str):
                for bad, advice in COPIED_RECIPE_NAMES.items():
                    if bad in name.lower().replace("trainer.", ""):
                        problems.append(f"config key '{where}': {advice}")
        problems += copied_recipe_problems(value, where)
    return problems


# --------------------------------------------------------------------------- runs and stacks


def run_names(cfg: Mapping[str, Any]) -> list[str]:
    return list(cfg.get("runs", {}) or {})


def run_config(cfg: Mapping[str, Any], run: str, validated: bool = True) -> dict[str, Any]:
    """The base config with the run's overlay merged in (and the ``runs`` table removed)."""
    runs = cfg.get("runs", {}) or {}
    if run not in runs:
        raise ConfigError(f"unknown run {run!r}; the config defines: {', '.join(runs) or 'no runs'}")
    base = {k: v for k, v in cfg.items() if k != "runs"}
    run_cfg = with_precision(with_defaults(deep_merge(base, runs[run] or {})))
    if validated:
        check({**run_cfg, "runs": {}}, f" (run '{run}')")
    return run_cfg


STACKS = tuple(s for s in enum("#/properties/stack") if s)  # null: $STACK


def resolve_stack(cfg: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """``stack`` from the config, else $STACK, else 'pinned'."""
    stack = cfg.get("stack") or environ.get("STACK") or "pinned"
    if stack not in STACKS:
        raise ConfigError(f"stack {stack!r} (from config key 'stack' or $STACK) must be one of {', '.join(STACKS)}")
    return stack


# --------------------------------------------------------------------------- hashing and stage keys


def stable_hash(obj: Any, length: int = 12) -> str:
    """A hash of a JSON-able object that is the same in every process (unlike ``hash()``)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def settings_key(
    prefix: str, settings: Callable[[Mapping[str, Any]], Mapping[str, Any]]
) -> Callable[[Mapping[str, Any]], str]:
    """The key function of a stage's output folder (results/<stage>/<key>): ``prefix-`` and the hash of what
    ``settings`` says the stage depends on."""

    def key(cfg: Mapping[str, Any]) -> str:
        return f"{prefix}-{stable_hash(settings(cfg))}"

    return key


def tokenizer_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the tokenizer depends on: its own settings, the sources and split it is trained on."""
    data = cfg["data"]
    return {
        "tokenizer": cfg["tokenizer"],
        "pretrained_model": cfg["model"].get("pretrained"),
        "sources": data["sources"],
        "split": data["split"],
        "on_bad_record": data["on_bad_record"],
    }


def data_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the tokenized shards depend on."""
    return {"tokenizer": tokenizer_settings(cfg), "data": cfg["data"]}


tokenizer_key = settings_key("t", tokenizer_settings)


data_key = settings_key("d", data_settings)


def base_model_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the base model depends on: a user's pretrained folder, or the embedded default's pretraining
    (then also rule pretrain_base's settings, :class:`PretrainStage`)."""
    model = cfg["model"]
    if model["pretrained"]:
        return {"pretrained": model["pretrained"]}
    return {
        "model": model,
        "pretrain": training(cfg["pretrain"]),
        "data": data_key(cfg),
        "precision": cfg["precision"],
        "seed": cfg["seed"],
    }


base_key = settings_key("b", base_model_settings)


def coverage_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "base": base_key(cfg),
        "data": data_key(cfg),
        "coverage": cfg["coverage"],
        "seed": cfg["seed"],
        "model": cfg["model"],
    }


coverage_key = settings_key("c", coverage_settings)

# The training section whose micro-batch sizes the experts choice: fine-tuning's for the fine-tuning stages and
# evaluation, pretraining's for the base model's stages (pretrain_base, coverage_valset), whose keys hold no train:.
EXPERTS_PARTS = ("train", "pretrain")


def experts_settings(cfg: Mapping[str, Any], part: str = "train") -> dict[str, Any]:
    """What the experts choice depends on (rule choose_experts, moeflow.experts_choice): the model, one
    micro-batch of ``part`` (one of EXPERTS_PARTS), the device and the precision."""
    model = cfg["model"]
    return {
        "model": {k: model[k] for k in ("pretrained", "trust_remote_code", "config", "experts_implementation")},
        "micro_batch_size": cfg[part]["micro_batch_size"],
        "seq_len": cfg["data"]["seq_len"],
        "device": cfg["hardware"]["device"],
        "precision": cfg["precision"],
    }


def experts_key(cfg: Mapping[str, Any], part: str = "train") -> str:
    return f"e-{stable_hash(experts_settings(cfg, part))}"


def eval_batch_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """How the evaluation sets are batched (``moeflow.eval_loop.batches``): what rules evaluate_run and
    routing_drift take from the ``evaluate`` section, so that a change to lm-eval or HumanEval settings does
    not rerun them."""
    return {key: cfg["evaluate"][key] for key in ("batch_size", "max_sequences")}


HUMANEVAL_GENERATION_KEYS = ("problems", "n_samples", "temperature", "top_p", "max_new_tokens", "batch_size")
HUMANEVAL_EXECUTION_KEYS = ("k", "timeout_s", "memory_mb")


def humaneval_generation_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule humaneval_generate depends on (:class:`HumanEvalGeneration`): the sampling settings, with
    ``seed`` null resolved to the run's. Execution's keys are left out: changing one generates nothing again."""
    humaneval = cfg["evaluate"]["humaneval"]
    seed = cfg["seed"] if humaneval["seed"] is None else humaneval["seed"]
    return {key: humaneval[key] for key in HUMANEVAL_GENERATION_KEYS} | {"seed": seed}


def humaneval_execution_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule humaneval_execute depends on besides the samples (:class:`HumanEvalExecution`)."""
    return {key: cfg["evaluate"]["humaneval"][key] for key in HUMANEVAL_EXECUTION_KEYS}


def plan_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the memory planner depends on: the model, the hardware and the training shape."""
    return {
        "model": cfg["model"],
        "vocab_size": cfg["tokenizer"].get("vocab_size"),
        "hardware": cfg["hardware"],
        "parallel": cfg["parallel"],
        "train": train_settings(cfg),
        "seq_len": cfg["data"]["seq_len"],
        "precision": cfg["precision"],
    }


# --------------------------------------------------------------------------- fine-tuning stages (warmup, train_model)

# Settings that only affect the part after warmup: changing them reruns train_model, not warmup.
AFTER_WARMUP_KEYS = (
    "steps",
    "warmup_ratio",
    "min_lr",
    "eval_every",
    "eval_max_sequences",
    "log_every",
    "peak_flops_per_s",
)


def resolve_warmup_steps(train: Mapping[str, Any]) -> int:
    """``warmup_steps``, or ``warmup_ratio`` times ``steps`` (never both: see semantic_problems); 0 without either."""
    if train["warmup_ratio"] is not None:
        return max(1, int(round(float(train["warmup_ratio"]) * int(train["steps"]))))
    return int(train["warmup_steps"] or 0)


def training(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``train:`` or ``pretrain:`` section as :class:`TrainSettings` takes it: the schema's defaults
    filled in, the warmup length resolved, ``balance.mode`` off for YAML's unquoted ``off`` (false), and
    ``lora`` only with ``method: lora`` (null otherwise, so that LoRA settings never rerun a full run)."""
    train = with_defaults(section, "#/$defs/training")
    return train | {
        "warmup_steps": resolve_warmup_steps(train),
        "balance": train["balance"] | {"mode": train["balance"]["mode"] or "off"},
        "lora": train["lora"] if train["method"] == "lora" else None,
    }


def train_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train:`` section as the training stages and the planner see it (:func:`training`)."""
    return training(cfg["train"])


def warmup_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the warmup stage depends on (:class:`WarmupStage`): base model, data, model/runtime settings
    and the training settings of the warmup part: ``train.warmup_steps`` steps, with the settings of the
    rest (AFTER_WARMUP_KEYS) at their defaults."""
    train = train_settings(cfg)
    defaults = schema_node("#/$defs/training")["properties"]
    after = {k: defaults[k]["default"] for k in AFTER_WARMUP_KEYS if k != "steps"}
    return {
        "base": base_key(cfg),
        "data": data_key(cfg),
        "finetune_corpus": cfg["data"]["finetune_corpus"],
        "model": cfg["model"],
        "hardware_device": cfg["hardware"]["device"],
        "parallel": cfg["parallel"],  # the ranks and their layout change the global batch and the sums
        "train": train | after | {"steps": train["warmup_steps"]},
        "precision": cfg["precision"],
        "seed": cfg["seed"],
    }


warmup_key = settings_key("w", warmup_settings)


def train_model_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What train_model depends on (:class:`TrainModelStage`): the whole training settings, the model, the
    warmup it continues from, the layout."""
    return {
        "train": train_settings(cfg),
        "model": cfg["model"],
        "warmup": warmup_key(cfg),
        "parallel": cfg["parallel"],
        "hardware_device": cfg["hardware"]["device"],
    }


def export_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """How train_model writes the final model folder (:class:`ExportSettings`): a rule param of its own,
    outside the training settings and the checkpoints' key."""
    return dict(cfg["export"])


# --------------------------------------------------------------------------- typed settings
#
# Frozen dataclasses, one per section a stage needs, with no defaults of their own: the rules pass a
# stage's settings as plain data (``params``; Snakemake compares them to decide reruns), and the stage
# script turns them into these with :func:`settings`. Field names are the config's keys.


@dataclass(frozen=True)
class BalanceSettings:
    """``train.balance`` / ``pretrain.balance``: the load-balancing terms of the loss (moeflow.losses)."""

    SCHEMA: ClassVar[str] = "#/$defs/balance"
    mode: str
    coef: float
    z_loss_coef: float
    bias_update_rate: float

    @property
    def balancing(self) -> bool:
        return self.mode != "off" and self.coef > 0

    @property
    def needs_router_grad(self) -> bool:
        """Whether a loss term differentiates through the router (else routing statistics carry no graph)."""
        return self.balancing or self.z_loss_coef > 0

    @property
    def needs_counting_forward(self) -> bool:
        return self.balancing and self.mode == "exact"


LORA_ALL = "all"


@dataclass(frozen=True)
class LoraSettings:
    """``train.lora``. ``targets`` keeps what the config names; ``categories`` resolves ``all``."""

    SCHEMA: ClassVar[str] = "#/$defs/lora"
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    router: str

    @property
    def categories(self) -> tuple[str, ...]:
        """The module categories that get adapters, in the schema's order."""
        every = tuple(t for t in enum("#/$defs/lora/properties/targets") if t != LORA_ALL)
        return every if LORA_ALL in self.targets else tuple(t for t in every if t in self.targets)

    def as_dict(self) -> dict[str, Any]:
        return plain(self)


@dataclass(frozen=True)
class RoutingThresholds:
    """``train.routing_guard`` (moeflow.guards.RoutingGuard)."""

    SCHEMA: ClassVar[str] = "#/$defs/routing_guard"
    window_steps: int
    max_load_ratio: float
    min_load_entropy: float
    max_dead_experts: int
    early_steps: int
    early_loss_drop: float
    early_entropy_drop: float
    reference: str
    max_load_ratio_growth: float
    max_load_entropy_drop: float


@dataclass(frozen=True)
class MemoryThresholds:
    """``train.memory_guard`` (moeflow.guards.MemoryGuard)."""

    SCHEMA: ClassVar[str] = "#/$defs/memory_guard"
    skip_steps: int
    window_steps: int
    max_slope_mib_per_step: float
    patience: int


@dataclass(frozen=True)
class TrainSettings:
    """The training loop's settings: a ``train:`` or ``pretrain:`` section after :func:`training`
    (``warmup_steps`` is the resolved warmup length; ``lora`` is None unless ``method`` is lora)."""

    SCHEMA: ClassVar[str] = "#/$defs/training"
    method: str
    optimizer: str
    micro_batch_size: int
    grad_accum_steps: int
    gradient_checkpointing: bool
    steps: int
    warmup_steps: int
    warmup_ratio: float | None
    lr: float
    min_lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    max_grad_norm: float
    router_lr_multiplier: float
    freeze_router: bool
    lora: LoraSettings | None
    balance: BalanceSettings
    routing_guard: RoutingThresholds
    memory_guard: MemoryThresholds
    log_every: int
    eval_every: int
    eval_max_sequences: int | None
    checkpoint_every: int
    detect_anomaly: bool
    peak_flops_per_s: float | None

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps


@dataclass(frozen=True)
class ParallelSettings:
    """``parallel``: the torchrun ranks and how they share the model (moeflow.distributed)."""

    SCHEMA: ClassVar[str] = "#/properties/parallel"
    nproc_per_node: int
    nnodes: int
    strategy: str
    ep_size: int
    fsdp_size: int | None
    ep_implementation: str

    @property
    def world_size(self) -> int:
        """The ranks the config asks for: ``nproc_per_node x nnodes``."""
        return self.nproc_per_node * self.nnodes


@dataclass(frozen=True)
class ExportSettings:
    """``export``: the final model folder (moeflow.export)."""

    SCHEMA: ClassVar[str] = "#/properties/export"
    max_shard_size: str


@dataclass(frozen=True)
class PretrainStage:
    """Rule pretrain_base (:func:`base_model_settings` of a model built from config)."""

    model: dict[str, Any]
    pretrain: TrainSettings
    data: str
    precision: str
    seed: int


@dataclass(frozen=True)
class WarmupStage:
    """Rule warmup (:func:`warmup_settings`)."""

    base: str
    data: str
    finetune_corpus: str
    model: dict[str, Any]
    hardware_device: str
    parallel: ParallelSettings
    train: TrainSettings
    precision: str
    seed: int


@dataclass(frozen=True)
class TrainModelStage:
    """Rule train_model (:func:`train_model_settings`)."""

    train: TrainSettings
    model: dict[str, Any]
    warmup: str
    parallel: ParallelSettings
    hardware_device: str


@dataclass(frozen=True)
class HumanEvalGeneration:
    """Rule humaneval_generate (:func:`humaneval_generation_settings`)."""

    problems: int | None
    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    seed: int


@dataclass(frozen=True)
class HumanEvalExecution:
    """Rule humaneval_execute (:func:`humaneval_execution_settings`)."""

    k: tuple[int, ...]
    timeout_s: float
    memory_mb: int


def settings(cls: type, data: Mapping[str, Any]) -> Any:
    """The typed settings ``cls`` (a dataclass above) of plain data: nested sections typed too, lists made
    tuples where the field is a tuple. Keys ``data`` leaves out take the schema's default (a rule passes
    whole settings, so only tests and saved files leave any out); a key without one is an error."""
    hints = typing.get_type_hints(cls)
    schema_path = getattr(cls, "SCHEMA", None)
    data = with_defaults(data, schema_path) if schema_path else dict(data)
    names = [f.name for f in dataclasses.fields(cls)]
    missing, unknown = [n for n in names if n not in data], sorted(set(data) - set(names))
    if missing or unknown:
        raise ConfigError(
            f"{cls.__name__}: missing {missing or 'nothing'}, "
            f"unknown {unknown or 'nothing'} (known: {', '.join(names)})"
        )
    return cls(**{name: _typed(hints[name], data[name]) for name in names})


def _typed(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        hint = next(k for k in typing.get_args(hint) if k is not type(None))
    if dataclasses.is_dataclass(hint):
        return settings(hint, value)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    if hint is float and type(value) is int:  # YAML reads 32 as an int
        return float(value)
    return value


def plain(typed: Any) -> dict[str, Any]:
    """Typed settings as plain JSON-able data (the inverse of :func:`settings`)."""
    return json.loads(json.dumps(dataclasses.asdict(typed)))
