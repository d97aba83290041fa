"""The config's checks: the schema, then what a schema cannot express, per run.

Each message names the key and what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jsonschema

from moeflow.evaluation.lm_eval_tasks import task_problems
from moeflow.families import registry
from moeflow.families.family import EXPERT_COUNT_KEYS
from moeflow.model.settings import quantization_problems as model_quantization_problems
from moeflow.parallel.settings import training_layout_problems as layout_problems
from moeflow.runtime import compat
from moeflow.serving.settings import unsupported_reason
from moeflow.settings import (
    REPO_ROOT,
    SCHEMA_PATH,
    SOURCE_SCHEMA,
    ConfigError,
    differing_keys,
    matches,
    schema,
    schema_node,
    with_defaults,
)
from moeflow.workflow.keys import forward_parallel
from moeflow.workflow.merge import merged_run, resolved_precision
from moeflow.workflow.recipe import copied_recipe_problems

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
    for name in cfg["runs"]:
        check({**merged_run(cfg, name), "runs": {}}, f" (run '{name}')")
    for problem in noise_run_problems(cfg):  # after the runs' own checks, whose messages say more about a bad run
        raise ConfigError(f"invalid configuration: {problem}")


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
    """Checks a schema cannot express, on a tree the schema accepted (its defaults filled in). Each message
    names the key(s) and what to do."""
    problems: list[str] = []
    data = cfg["data"]
    if data["split"]["heldout"] + data["split"]["test"] >= 1:
        problems.append("config keys 'data.split.heldout' + 'data.split.test' must sum to less than 1")
    for corpus, source in data["sources"].items():  # a corpus name is a folder under results/: no '/', no '..'
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
    model = cfg["model"]
    if model["trust_remote_code"] and not model["pretrained"]:
        problems.append(
            "config key 'model.trust_remote_code' is on but 'model.pretrained' is not set: it may only be "
            "turned on for a named model folder whose code you trust"
        )
    if model["pretrained"] and not Path(model["pretrained"]).is_dir():
        problems.append(pretrained_folder_problem(model["pretrained"]))
    elif model["pretrained"] and not model["trust_remote_code"]:
        problems += model_type_problems(Path(model["pretrained"]))
    if cfg["pretrain"]["method"] != "full":
        problems.append("config key 'pretrain.method': pretraining trains the whole base model; use method: full")
    named = data["eval_corpora"] + cfg["coverage"]["pool_corpora"]
    for corpus in named + [data["base_corpus"], data["finetune_corpus"]]:
        if corpus not in data["sources"]:
            problems.append(
                f"config key 'data': corpus {corpus!r} is not among 'data.sources' "
                f"({', '.join(sorted(data['sources']))})"
            )
    for section in ("train", "pretrain"):
        train = cfg[section]
        if train["warmup_steps"] is not None and train["warmup_ratio"] is not None:
            problems.append(
                f"config keys '{section}.warmup_steps' and '{section}.warmup_ratio' are both set; give one of them "
                "(set the other to null), e.g. warmup_steps: 1000 or warmup_ratio: 0.1"
            )
        if train["warmup_steps"] and train["warmup_steps"] >= train["steps"]:
            problems.append(
                f"config key '{section}.warmup_steps' ({train['warmup_steps']}) "
                f"must be less than '{section}.steps' ({train['steps']})"
            )
        if train["min_lr"] > train["lr"]:
            problems.append(
                f"config key '{section}.min_lr' ({train['min_lr']}) must not exceed '{section}.lr' ({train['lr']})"
            )
    problems += parallel_problems(cfg)
    problems += optimizer_problems(cfg)
    problems += esft_problems(cfg)
    problems += quantization_problems(cfg)
    problems += mtp_problems(cfg)
    problems += attention_problems(cfg)
    problems += humaneval_problems(cfg)
    problems += lm_eval_problems(cfg)
    problems += serve_problems(cfg)
    return problems


def serve_problems(cfg: Mapping[str, Any]) -> list[str]:
    """serve.python must be a Python that exists (rule serve_check starts vLLM with it)."""
    python = cfg["serve"]["python"]
    if python is None or Path(python).is_file():
        return []
    return [
        f"config key 'serve.python': {python} does not exist: make the serving environment with `make serve-env` "
        "(.venvs/serve/bin/python, as config/serve.yaml names it), or set the key to a Python with vLLM installed, "
        "or to null (no serving check)"
    ]


def lm_eval_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Every evaluate.tasks entry must resolve (moeflow.evaluation.lm_eval_tasks); moeflow_perplexity's documents are
    segments of up to data.seq_len tokens, each scored in one window of evaluate.lm_eval.max_length; the vllm engine
    needs what :func:`engine_problems` says, and its positions within the model's."""
    tasks, data = cfg["evaluate"]["tasks"], cfg["data"]
    problems = task_problems(tasks, data["eval_corpora"])
    max_length, seq_len = cfg["evaluate"]["lm_eval"]["max_length"], data["seq_len"]
    if "moeflow_perplexity" in tasks and max_length is not None and max_length < seq_len:
        problems.append(
            f"config key 'evaluate.lm_eval.max_length' ({max_length}) is below 'data.seq_len' ({seq_len}): "
            "moeflow_perplexity scores each packed segment in one window; raise it or set null"
        )
    if tasks and cfg["evaluate"]["lm_eval"]["engine"] == "vllm":
        problems += engine_problems(cfg, "lm_eval") or _engine_context_problems(cfg, (max_length or seq_len) + 2)
    return problems


def _engine_context_problems(cfg: Mapping[str, Any], positions: int) -> list[str]:
    """lm-eval's vLLM backend asks the engine for ``positions`` (moeflow.serving.engine), which vLLM refuses beyond
    the model's max_position_embeddings."""
    _, config = _model_type_and_experts(cfg["model"])
    limit = config.get("max_position_embeddings")
    if limit is None or positions <= limit:
        return []
    return [
        f"config key 'evaluate.lm_eval.engine' is vllm, which scores up to evaluate.lm_eval.max_length (null: "
        f"data.seq_len) + 2 positions ({positions}), beyond the model's max_position_embeddings ({limit}): lower "
        "evaluate.lm_eval.max_length (at least data.seq_len for moeflow_perplexity), or use engine: hf"
    ]


def engine_problems(cfg: Mapping[str, Any], section: str) -> list[str]:
    """``evaluate.<section>.engine: vllm`` needs the serving environment, a family its build runs, and one process."""
    if cfg["evaluate"][section]["engine"] != "vllm":
        return []
    key = f"evaluate.{section}.engine"
    if cfg["serve"]["python"] is None:
        return [
            f"config key '{key}' is vllm but 'serve.python' is null: make the serving "
            "environment (`make serve-env`) and pass --configfile config/serve.yaml, or use engine: hf"
        ]
    model_type, _ = _model_type_and_experts(cfg["model"])
    reason = unsupported_reason(model_type or "", cfg["hardware"]["device"])
    if reason:
        return [f"config key '{key}' is vllm, which cannot run {model_type} on the CPU here: {reason}; use engine: hf"]
    if cfg["evaluate"]["ranks"] > 1:
        return [
            f"config key '{key}' is vllm, which holds the model in one process, but "
            f"'evaluate.ranks' is {cfg['evaluate']['ranks']}: set evaluate.ranks: 1, or use engine: hf"
        ]
    return []


def humaneval_problems(cfg: Mapping[str, Any]) -> list[str]:
    """pass@k estimates from n samples per problem exist for k <= n only; the vllm engine needs what
    :func:`engine_problems` says."""
    humaneval = cfg["evaluate"]["humaneval"]
    n = humaneval["n_samples"]
    if humaneval["enabled"]:
        problems = engine_problems(cfg, "humaneval")
        if problems:
            return problems
    return [
        f"config key 'evaluate.humaneval.k[{i}]' ({k}) exceeds 'evaluate.humaneval.n_samples' ({n}): pass@k needs at "
        "least k sampled completions per problem; raise n_samples or drop that k"
        for i, k in enumerate(humaneval["k"])
        if k > n
    ]


def esft_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``train.method: esft`` needs an MoE model whose experts moeflow can address (a family moeflow reads the
    routing of, moeflow.families.registry.FAMILIES), rows it can mask (a fused expert tensor under FSDP1
    splits elements, not experts), and routing left alone (the routers are frozen, so no loss-free bias update)."""
    train = cfg["train"]
    if train["method"] != "esft":
        return []
    problems = []
    model_type, experts = _model_type_and_experts(cfg["model"])
    dense = [f"{k}={experts[k]}" for k in EXPERT_COUNT_KEYS if k in experts and int(experts[k] or 0) <= 1]
    if dense:
        problems.append(
            f"config key 'train.method': esft trains a task's routed experts, but the model is dense ({dense[0]}): "
            "use train.method: full or lora"
        )
    elif model_type is not None and model_type not in registry.FAMILIES:
        problems.append(
            f"config key 'train.method': esft scores and masks experts through a routing adapter, and model_type "
            f"{model_type!r} has none (moeflow.families.registry.FAMILIES: {', '.join(registry.FAMILIES)}): "
            "use train.method: full or lora"
        )
    if train["balance"]["bias_update_rate"] > 0:
        problems.append(
            "config keys 'train.method': esft and 'train.balance.bias_update_rate' > 0 do not combine: ESFT keeps the "
            "routing frozen, and the loss-free bias update moves it. Set train.balance.bias_update_rate: 0"
        )
    return problems


def quantization_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``model.quantization`` (moeflow.model.settings.quantization_problems)."""
    train = cfg["train"]
    return model_quantization_problems(
        cfg["model"]["quantization"],
        train["method"],
        train["gradient_checkpointing"],
        tuple(train["lora"]["targets"]),
    )


MTP_ATTENTION = ("eager", "sdpa")  # moeflow.model.mtp_loss builds each MTP layer's per-document mask itself


def mtp_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``mtp.mode: train`` needs MTP layers (a family moeflow builds them for, num_nextn_predict_layers > 0), a
    full fine-tune (LoRA and ESFT leave them out), and eager or sdpa attention (moeflow.model.mtp_loss). Every
    layout: each MTP depth runs in one call of its layer, which FSDP gathers (moeflow.families.mtp.MTPLayer)."""
    problems = []
    for section in ("train", "pretrain"):
        train = cfg[section]
        if train["mtp"]["mode"] != "train":
            continue
        key = f"config key '{section}.mtp.mode': train"
        model_type, config = _model_type_and_experts(cfg["model"])
        depth = int(config.get("num_nextn_predict_layers") or 0)
        families = registry.MTP_FAMILIES
        if model_type is not None and (model_type not in families or depth < 1):
            problems.append(
                f"{key} needs a model with MTP layers ({', '.join(families)} with num_nextn_predict_layers > 0); "
                f"model_type {model_type!r} has {depth if model_type in families else 'none'}. "
                f"Set {section}.mtp.mode: frozen"
            )
        if train["method"] != "full":
            problems.append(
                f"{key} trains the MTP layers in full, and {section}.method is {train['method']!r} (which leaves them "
                f"frozen): use {section}.method: full, or {section}.mtp.mode: frozen"
            )
        if cfg["model"]["attn_implementation"] not in MTP_ATTENTION:
            problems.append(
                f"{key}: the MTP loss runs with eager or sdpa attention only, and model.attn_implementation is "
                f"{cfg['model']['attn_implementation']!r}: set model.attn_implementation: sdpa"
            )
    return problems


def _model_type_and_experts(model: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The model type and the config's keys (expert counts among them) of ``model.config``, or of the pretrained
    folder's config.json (None, {} where it cannot be read: the stage that loads it says why)."""
    if not model["pretrained"]:
        config = model["config"] or {}
    else:
        try:
            config = json.loads((Path(model["pretrained"]) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None, {}
    return config.get("model_type"), {**(config.get("text_config") or {}), **config}


def attention_problems(cfg: Mapping[str, Any]) -> list[str]:
    """flash-attn refuses fp32 inputs (it would fail at the first forward): flash_attention_2 needs bf16; and a
    family whose transformers classes do not support flash-attn fails at load with it."""
    if cfg["model"]["attn_implementation"] != "flash_attention_2":
        return []
    model_type, _ = _model_type_and_experts(cfg["model"])
    if model_type in registry.NO_FLASH_ATTENTION:
        return [
            f"config key 'model.attn_implementation': flash_attention_2 cannot load {model_type}: transformers "
            f"{compat.version_of('transformers')} marks its attention as not supporting flash-attn, so the load "
            "would fail. Use sdpa (the memory planner counts its attention masks)"
        ]
    if resolved_precision(cfg) != "fp32":
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
    branch = node["then"] if matches(node["if"], {"type": kind}) else node["else"]
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
        return []  # moeflow.model.folder names what the folder lacks when a stage loads it
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    model_type = config.get("model_type")
    # transformers' model tables, imported only for a pretrained folder (they import torch: seconds at DAG build)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = f"config key 'model.pretrained': {folder}/config.json names model_type {model_type!r}"
    if model_type in registry.CURRENT_STACK_ONLY and model_type not in registry.causal_lm_types():
        return [
            f"{where}, which transformers {transformers.__version__} does not have: it needs transformers 5, "
            "the 'current' stack (STACK=current), where moeflow builds its causal LM without remote code"
        ]
    if model_type not in CONFIG_MAPPING_NAMES:
        return [
            f"{where}, which transformers {transformers.__version__} does not have: a model this new needs "
            "transformers 5 (the 'current' stack, STACK=current) or a newer release"
        ]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in registry.causal_lm_types():
        return [
            f"{where}: transformers {transformers.__version__} has its config but no causal-LM class for it "
            "(AutoModelForCausalLM cannot load it), and moeflow fine-tunes causal language models only"
        ]
    family = registry.FAMILIES.get(model_type)
    if family is not None and family.config_problems is not None:
        return family.config_problems(config, f"config key 'model.pretrained': {config_file}")
    return []


def run_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Checks of the runs table against the base config: names, what a run may change, the paper's runs."""
    problems = []
    runs = cfg["runs"]
    for name, overlay in runs.items():
        if not RUN_NAME.match(name):
            problems.append(f"config key 'runs.{name}': run names may use letters, digits, '_', '.', '-' only")
            continue
        changes_model = "config" in ((overlay or {}).get("model") or {})
        if changes_model and merged_run(cfg, name)["model"]["pretrained"]:
            problems.append(
                f"config key 'runs.{name}.model.config': run {name!r} changes model.config, "
                "but model.pretrained is set: "
                "the pretrained folder's config.json is the model. Give the run its own model.pretrained folder, or "
                f"drop it (runs: {{{name}: null}})"
            )
    for name in [cfg["paper"]["moe_run"], *cfg["paper"]["dense_runs"]]:
        if name not in runs:
            problems.append(
                f"config keys 'paper.moe_run' / 'paper.dense_runs': {name!r} is not a run ({', '.join(runs)})"
            )
    return problems


# What the seed-noise run (paper.noise_run) may change of paper.moe_run: its seed, and whose coverage validation set it
# is validated on (the MoE run's, so that their losses are on the same set).
NOISE_RUN_KEYS = ("seed", "coverage.valset_of_run")


def noise_run_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``paper.noise_run`` must name a run that differs from ``paper.moe_run`` in its seed and nothing else
    (NOISE_RUN_KEYS): the paper reports |moe_run - noise_run| as the seed-to-seed noise of its comparisons."""
    paper, runs = cfg["paper"], cfg["runs"]
    noise, moe = paper.get("noise_run"), paper["moe_run"]
    if noise is None or moe not in runs:
        return []
    where = f"config key 'paper.noise_run': {noise!r}"
    off = "or set paper.noise_run: null (the paper then says the seed noise was not measured)"
    if noise not in runs:
        return [f"{where} is not a run ({', '.join(runs)}): add the run, moe_run with another seed, {off}"]
    if noise == moe:
        return [f"{where} is paper.moe_run itself: name a run that is {moe!r} with another seed, {off}"]
    differs = differing_keys(merged_run(cfg, moe), merged_run(cfg, noise))
    other = [key for key in differs if key not in NOISE_RUN_KEYS]
    if other:
        return [
            f"{where} must differ from paper.moe_run {moe!r} in its seed only (and coverage.valset_of_run), but it "
            f"also differs in {', '.join(other)}: make it {moe!r} with another seed, {off}"
        ]
    if "seed" not in differs:
        return [f"{where} has the seed of paper.moe_run {moe!r}: give it another seed, {off}"]
    return []


def parallel_problems(cfg: Mapping[str, Any]) -> list[str]:
    """The ``parallel`` layout must add up: world = nproc_per_node x nnodes = hardware.num_devices, and
    the FSDP and expert-parallel sizes must tile it the way transformers' DistributedConfig requires."""
    par = cfg["parallel"]
    world = par["nproc_per_node"] * par["nnodes"]
    strategy, ep, fsdp = par["strategy"], par["ep_size"], par["fsdp_size"]
    problems = []
    devices = cfg["hardware"]["num_devices"]
    if world > 1 and devices != world:
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
    if par["ep_implementation"] == "all_reduce":
        problems.append(
            "config key 'parallel.ep_implementation': all_reduce needs transformers' ep_size equal to its tensor-"
            "parallel size, and moeflow runs no tensor parallelism (tp_size 1): use all_to_all, or auto (all_to_all "
            "in training)"
        )
    problems += training_layout_problems(cfg)
    problems += forward_layout_problems(cfg)
    return problems


def training_layout_problems(cfg: Mapping[str, Any]) -> list[str]:
    """What the training layout cannot run (moeflow.parallel.settings.training_layout_problems), known here rather
    than at load."""
    par = cfg["parallel"]
    model_type, config = _model_type_and_experts(cfg["model"])
    return layout_problems(
        cfg["train"]["method"],
        par["strategy"],
        par["nproc_per_node"] * par["nnodes"],
        tied_embeddings=bool(config.get("tie_word_embeddings")),
        model_type=model_type,
        cpu_offload=par["cpu_offload"],
        lora_router=(cfg["train"].get("lora") or {}).get("router", "frozen"),
        lora_targets=tuple((cfg["train"].get("lora") or {}).get("targets", ())),
    )


def forward_layout_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Each forward-only stage's layout (moeflow.workflow.keys.forward_parallel: coverage.* for coverage_valset and
    esft_routing, evaluate.* for the evaluation stages) must tile its ranks, as training's must: refused here, not
    after the data stages ran."""
    problems = []
    for section in ("coverage", "evaluate"):
        layout = forward_parallel(cfg, section)
        ranks, ep = layout["nproc_per_node"], layout["ep_size"]
        if layout["strategy"] == "ep" and (ep < 2 or ranks % ep):
            problems.append(
                f"config keys '{section}.ranks' ({ranks}), '{section}.strategy' ({cfg[section]['strategy']}) and "
                f"'parallel.ep_size' ({cfg['parallel']['ep_size']}): the {section} stages run expert parallelism on "
                f"{ranks} rank(s), and ep_size must be at least 2 and divide them. Set {section}.ranks to a multiple "
                f"of parallel.ep_size, or {section}.strategy: fsdp (or none on one rank)"
            )
    return problems


def optimizer_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``optimizer: muon`` where it is implemented only: the current stack (torch.optim.Muon) and full fine-tuning
    (every layout: moeflow.train.optimizers)."""
    problems = []
    for section in ("train", "pretrain"):
        train = cfg[section]
        if train["optimizer"] != "muon":
            continue
        key = f"config key '{section}.optimizer'"
        if not compat.torch_has_muon():
            problems.append(
                f"{key}: muon needs torch.optim.Muon (torch 2.9+, the current stack); this environment has torch "
                f"{compat.version_of('torch')}. Run with STACK=current, or use optimizer: adamw"
            )
        if train["method"] != "full":
            problems.append(
                f"{key}: muon is implemented for method: full only ({section}.method is {train['method']!r}); "
                "use optimizer: adamw"
            )
    return problems
