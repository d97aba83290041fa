"""Load, merge, validate and hash the configuration; list the runs.

The configuration is one YAML tree (``config/config.yaml`` plus any overlays). A *run* is a named
overlay of that tree (``runs: {dense: {model: ...}}``); every run's merged config is validated on its
own. Stage outputs are keyed by a hash of exactly the settings that stage depends on, so two runs that
agree on, say, the data settings share the data stages.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"
STACKS = ("pinned", "current")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


# --------------------------------------------------------------------------- loading and merging


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively by ``overlay`` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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
    """Read the default config, merge the given overlay files and overrides, and validate the result."""
    cfg = read_yaml(DEFAULT_CONFIG)
    for path in paths:
        cfg = deep_merge(cfg, read_yaml(path))
    if overrides:
        cfg = deep_merge(cfg, overrides)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- validation


def _schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


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
    """Validate the base config and every run's merged config; raise ConfigError naming each bad key."""
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(_schema())
    validator = validator_cls(_schema())

    def check(tree: Mapping[str, Any], label: str) -> None:
        for problem in copied_recipe_problems(tree):  # before the schema, whose message would be vaguer
            raise ConfigError(f"invalid configuration{label}: {problem}")
        errors = sorted(validator.iter_errors(tree), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            lines = "\n".join(f"  - {_describe(e)}" for e in errors)
            raise ConfigError(f"invalid configuration{label}:\n{lines}\n(schema: {SCHEMA_PATH.relative_to(REPO_ROOT)})")
        for problem in semantic_problems(tree):
            raise ConfigError(f"invalid configuration{label}: {problem}")

    check(cfg, "")
    for name in cfg.get("runs", {}):
        if not RUN_NAME.match(name):
            raise ConfigError(f"config key 'runs.{name}': run names may use letters, digits, '_', '.', '-' only")
        check({**run_config(cfg, name, validated=False), "runs": {}}, f" (run '{name}')")


def semantic_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Checks a schema cannot express. Each message names the key(s) and what to do."""
    problems: list[str] = []
    data = cfg.get("data", {})
    split = data.get("split", {})
    if split and split.get("heldout", 0) + split.get("test", 0) >= 1:
        problems.append("config keys 'data.split.heldout' + 'data.split.test' must sum to less than 1")
    for corpus in data.get("sources", {}):  # a corpus name is a folder under results/: no '/', no '..'
        if not RUN_NAME.match(str(corpus)):
            problems.append(f"config key 'data.sources.{corpus}': corpus names may use letters, digits, '_', '.', '-' only "
                            "(the name is a folder under results/)")
    model = cfg.get("model") or {}
    if model.get("trust_remote_code") and not model.get("pretrained"):
        problems.append("config key 'model.trust_remote_code' is on but 'model.pretrained' is not set: it may only be "
                        "turned on for a named model folder whose code you trust")
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
            problems.append(f"config key '{section}.warmup_steps' ({train['warmup_steps']}) must be less than '{section}.steps' ({train['steps']})")
        if train.get("min_lr") is not None and train.get("lr") is not None and train["min_lr"] > train["lr"]:
            problems.append(f"config key '{section}.min_lr' ({train['min_lr']}) must not exceed '{section}.lr' ({train['lr']})")
    problems += parallel_problems(cfg)
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
        problems.append("config key 'parallel.fsdp_size' is set but parallel.strategy is 'none': use strategy: fsdp or ep")
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
            f"'{flag}' is not a transformers flag; expert parallelism is transformers 5's DistributedConfig(ep_size=...): "
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
        return f"'{flag}: {value}' is refused: experts are grouped by device under expert parallelism (parallel.ep_size), nothing else"
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
        where = f"{path}.{key}" if path and not isinstance(key, int) else f"{path}[{key}]" if isinstance(key, int) else str(key)
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
    merged = deep_merge(base, runs[run] or {})
    if validated:
        validate({**merged, "runs": {}})
    return merged


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


def tokenizer_key(cfg: Mapping[str, Any]) -> str:
    return "t-" + stable_hash(tokenizer_settings(cfg))


def data_key(cfg: Mapping[str, Any]) -> str:
    return "d-" + stable_hash(data_settings(cfg))


def base_model_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the base model depends on: a user's pretrained folder, or the embedded default's pretraining."""
    model = cfg["model"]
    if model.get("pretrained"):
        return {"pretrained": model["pretrained"]}
    return {
        "model": model,
        "pretrain": cfg.get("pretrain", {}),
        "data": data_key(cfg),
        "precision": cfg["precision"],
        "seed": cfg["seed"],
    }


def base_key(cfg: Mapping[str, Any]) -> str:
    return "b-" + stable_hash(base_model_settings(cfg))


def coverage_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"base": base_key(cfg), "data": data_key(cfg), "coverage": cfg["coverage"], "seed": cfg["seed"], "model": cfg["model"]}


def coverage_key(cfg: Mapping[str, Any]) -> str:
    return "c-" + stable_hash(coverage_settings(cfg))


def plan_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the memory planner depends on: the model, the hardware and the training shape."""
    return {
        "model": cfg["model"],
        "vocab_size": cfg["tokenizer"].get("vocab_size"),
        "hardware": cfg["hardware"],
        "train": train_settings(cfg),
        "seq_len": cfg["data"]["seq_len"],
        "precision": cfg["precision"],
    }


# --------------------------------------------------------------------------- fine-tuning stages (warmup, train_model)

# Settings that only affect the part after warmup: changing them reruns train_model, not warmup.
AFTER_WARMUP_KEYS = ("steps", "warmup_ratio", "min_lr", "eval_every", "eval_max_sequences", "log_every", "peak_flops_per_s")


def train_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train:`` section as the training stages and the planner see it: ``train.lora`` only when
    ``train.method`` is ``lora``, so that LoRA settings never rerun a full fine-tune."""
    train = dict(cfg["train"])
    if train.get("method", "full") != "lora":
        train.pop("lora", None)
    return train


def resolve_warmup_steps(train: Mapping[str, Any]) -> int:
    """``train.warmup_steps``, or ``train.warmup_ratio`` times ``train.steps`` (never both: see semantic_problems)."""
    if train.get("warmup_steps") is not None and train.get("warmup_ratio") is not None:
        raise ConfigError("config keys 'train.warmup_steps' and 'train.warmup_ratio' are both set; give one of them")
    if train.get("warmup_ratio") is not None:
        return max(1, int(round(float(train["warmup_ratio"]) * int(train["steps"]))))
    return int(train.get("warmup_steps") or 0)


def warmup_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the warmup stage depends on: base model, data, model/runtime settings and the training
    settings of the warmup part (with the warmup length resolved), not those of the rest."""
    train = {k: v for k, v in train_settings(cfg).items() if k not in AFTER_WARMUP_KEYS}
    train["warmup_steps"] = resolve_warmup_steps(cfg["train"])
    return {
        "base": base_key(cfg),
        "data": data_key(cfg),
        "finetune_corpus": cfg["data"]["finetune_corpus"],
        "model": cfg["model"],
        "hardware_device": cfg["hardware"]["device"],
        "parallel": cfg.get("parallel") or {},  # the ranks and their layout change the global batch and the sums
        "train": train,
        "precision": cfg["precision"],
        "seed": cfg["seed"],
    }


def warmup_key(cfg: Mapping[str, Any]) -> str:
    return "w-" + stable_hash(warmup_settings(cfg))
