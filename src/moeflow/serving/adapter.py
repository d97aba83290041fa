"""A LoRA run's adapter in the layout serving engines read, and whether vLLM's own adapter loader reads it whole.

moeflow saves an adapter as peft does on the training stack (moeflow.model.lora.save_adapter). On transformers 5 the
routed experts' adapters are one rank-r adapter per expert over a fused tensor (peft ``target_parameters``), which
vLLM 0.32 refuses for Qwen3-MoE unless started in a mixed mode. vLLM's MoE LoRA reads one adapter per expert and
projection under the model files' names (``mlp.experts.<e>.gate_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1``)
and stacks them into its fused w13 and w2 itself. The serving adapter is that: every fused adapter split by expert,
exactly, at rank r (moeflow.model.adapter_layout.split_fused, which needs no model here); an adapter saved on
transformers 4.57 is in that layout already. A trainable router is no LoRA a serving engine applies: such a run has
no serving adapter (serve its merged model).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from moeflow.model.adapter_layout import PEFT_PREFIX, PIECES_FILE, split_fused
from moeflow.model.lora import SETTINGS_FILE
from moeflow.runtime.files import atomic_dir, read_json, write_json
from moeflow.serving.process import ServeCheckError, run_engine

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def serving_weights(adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter's tensors with every fused routed-expert adapter split into one adapter per expert module."""
    from safetensors.torch import load_file

    folder = Path(adapter_dir)
    return split_fused(load_file(str(folder / ADAPTER_FILE)), folder, None)


def adapted_modules(weights: dict[str, torch.Tensor]) -> list[str]:
    """The modules an adapter's tensors adapt (``model.layers.0.mlp.experts.3.up_proj``), sorted."""
    return sorted({key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for key in weights if ".lora_" in key})


def write_serving_adapter(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    r"""The serving adapter of ``adapter_dir`` (a moeflow LoRA adapter) written whole into ``out_dir``: its tensors
    (:func:`serving_weights`), a peft config whose ``target_modules`` match exactly the adapted modules (every expert
    of each, by ``\d+``) and which has no ``target_parameters``, and moeflow's LoRA settings
    (moeflow.model.lora.load_adapter loads it on either stack). Refuses an adapter whose routed experts stay fused
    (a family whose files keep them fused: moeflow.serving.settings.FUSED_IN_FILES). Returns what it wrote."""
    from safetensors.torch import save_file

    folder = Path(adapter_dir)
    weights = {key: value.contiguous() for key, value in serving_weights(folder).items()}
    modules = adapted_modules(weights)
    fused = [m for m in modules if m.endswith(".experts") or ".experts.base_layer" in m]
    if fused:
        raise ServeCheckError(
            f"{folder}: the routed experts' adapters stay fused ({', '.join(fused[:3])}): no per-expert layout to "
            "write; serve the run's merged model"
        )
    config = read_json(folder / CONFIG_FILE)
    patterns = sorted({module_pattern(m) for m in modules})
    config["target_modules"] = "(?:" + "|".join(patterns) + ")"  # peft matches a string by re.fullmatch
    config["target_parameters"] = None
    with atomic_dir(out_dir) as tmp:
        save_file(weights, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, config)
        write_json(tmp / SETTINGS_FILE, read_json(folder / SETTINGS_FILE))
    return {
        "modules": len(modules),
        "expert_modules": sum(".experts." in m for m in modules),
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "split_from_fused": (folder / PIECES_FILE).is_file(),
    }


def module_pattern(module: str) -> str:
    """A regular expression of ``module``'s name that any expert index matches (``experts.3.up_proj``: every
    expert's ``up_proj``), so a config names each adapted projection once, not once per expert."""
    head, sep, tail = module.partition(".experts.")
    index, dot, rest = tail.partition(".")
    if sep and dot and index.isdigit():
        return re.escape(f"{head}.experts.") + r"\d+" + re.escape(f".{rest}")
    return re.escape(module)


def engine_read_differences(
    serving_dir: str | os.PathLike, engine: dict[str, Any], read: dict[str, torch.Tensor]
) -> list[str]:
    """Every way vLLM's adapter loader (moeflow.serving.engine's ``--adapter``: ``engine`` its record, ``read`` the
    factors it holds, ``<module>.lora_a`` and ``.lora_b``) did not read the serving adapter at ``serving_dir`` as
    written: a module it lacks, a factor that differs, a scaling other than alpha / r. Empty: read whole."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(serving_dir) / ADAPTER_FILE))
    config = read_json(Path(serving_dir) / CONFIG_FILE)
    problems = []
    if engine["scaling"] != config["lora_alpha"] / config["r"]:
        problems.append(f"scaling {engine['scaling']}, not lora_alpha / r = {config['lora_alpha'] / config['r']}")
    for module in adapted_modules(weights):
        name = engine["names"].get(module)
        if name is None:
            problems.append(f"{module}: not read")
            continue
        for factor in ("A", "B"):
            mine, theirs = weights[f"{PEFT_PREFIX}{module}.lora_{factor}.weight"], read[f"{name}.lora_{factor.lower()}"]
            if mine.shape != theirs.shape or not torch.equal(mine.float(), theirs.float()):
                problems.append(f"{module}: lora_{factor} read as {tuple(theirs.shape)}, written {tuple(mine.shape)}")
    return problems


def engine_read_adapter(
    python: str | os.PathLike, model_dir: str | os.PathLike, adapter_dir: str | os.PathLike, timeout_s: float
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """How vLLM's adapter loader reads the adapter at ``adapter_dir`` for the model at ``model_dir`` (no model is
    loaded): the engine's record and the factors it holds (moeflow.serving.engine's ``--adapter``)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="moeflow-serve-") as tmp:
        read = Path(tmp) / "read.safetensors"
        record = run_engine(python, model_dir, ["--adapter", str(adapter_dir), "--read", str(read)], timeout_s)
        return record, load_file(str(read))


def check_serving_adapter(
    python: str | os.PathLike, model_dir: str | os.PathLike, adapter_dir: str | os.PathLike, timeout_s: float
) -> dict[str, Any]:
    """The serving adapter at ``adapter_dir`` read by vLLM's own adapter loader (:func:`engine_read_adapter`):
    what it read, or a ServeCheckError naming every module it did not read as written."""
    engine, read = engine_read_adapter(python, model_dir, adapter_dir, timeout_s)
    problems = engine_read_differences(adapter_dir, engine, read)
    if problems:
        raise ServeCheckError(
            f"vLLM {engine['version']}'s adapter loader does not read {adapter_dir} as written: "
            + "; ".join(problems[:10])
            + ". Serve the run's merged model, or report the layout vLLM expects"
        )
    return {
        "read_by": f"vllm {engine['version']}",
        "modules": len(engine["names"]),
        "stacked_moe_layers": len(engine["stacked"]),
        "scaling": engine["scaling"],
    }
