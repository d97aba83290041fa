"""The one door to a model: build or load one for a layout, device and dtype (:func:`make_model`).

Every model moeflow trains or evaluates comes from here: :func:`make_model` builds one from ``model.config``
(seeded) or loads a local folder (safetensors only, the folder's own code only with
``model.trust_remote_code``), for a layout (``parallel.strategy`` none, fsdp or ep, LoRA adapters for
``train.method: lora``), on a device, in a dtype. It applies the rule's experts choice for
``model.experts_implementation: auto`` (moeflow.model.experts_choice) and installs the chunked loss
(moeflow.model.chunked_loss) on every model it returns. ``moeflow.checkpoint.export`` writes the final one.

How a folder is loaded, by layout (:class:`Layout`):

* Every model (``none``, ``fsdp`` and ``ep``, any number of ranks): the folder's model class built with
  its parameters on the meta device in the target dtype (what ``from_pretrained`` keeps in float32 kept so:
  :func:`keep_in_fp32`), sharded, then each rank's rows read from the folder's safetensors files
  (moeflow.parallel.rank_load): no rank holds what it does not own, and one rank holds the weights once
  (transformers 5's ``from_pretrained`` keeps the files mapped beside the tensors it copies: ~1.3x the
  weights at one rank; under ``ep`` it read every expert on every rank). ``ep`` (transformers 5) is sharded
  on the meta device as ``from_pretrained`` shards it for its ``DistributedConfig`` (experts over
  ``ep_size`` ranks, the rest FSDP2-sharded), so each rank reads its experts only; it needs a folder and
  refuses tied embeddings. ``weights=False``: the caller loads a checkpoint that replaces every parameter and
  persistent buffer, so no weight is read.
* LoRA: the adapters are put on the meta model before it is sharded (peft's ``get_peft_model``; a LoRA unit holds
  its frozen base and its adapters), the base weights read as above, and the adapters given their seeded start
  (moeflow.model.lora.initial_adapters): the same on every rank and in every layout. LoRA runs under ``none``,
  ``fsdp`` (FSDP2) and ``ep``, where the adapters go on before transformers shards the model and the routed
  experts' are split by experts with them (moeflow.model.expert_lora). With
  ``model.quantization`` the base's weight matrices are quantized first (moeflow.model.quantization), on the meta
  device, and each rank quantizes the rows it reads; under ``ep`` a fused expert tensor's stored bytes are split by
  experts as the tensor would be (moeflow.model.quantized_experts).

Every model class and config comes from ``moeflow.model.configs`` (``causal_lm_class``: the one place where a
family transformers does not register for ``AutoModelForCausalLM`` is registered).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeflow.families.mtp import unfreeze_mtp_layers
from moeflow.model.chunked_loss import install as install_chunked_loss
from moeflow.model.configs import build_config, causal_lm_class, transformers_config
from moeflow.model.expert_lora import ep_plan
from moeflow.model.folder import ModelError, check_vocabulary, refusing_remote_code
from moeflow.model.lora import apply_lora, initial_adapters, is_lora_model, router_modules
from moeflow.model.quantization import quantize_base
from moeflow.model.quantized_experts import split_quantized_experts
from moeflow.model.settings import AUTO_EXPERTS, STACK_DEFAULT_EXPERTS, ModelSettings, quantization_problems
from moeflow.model.wrappers import unwrap
from moeflow.parallel.layouts import distributed_config, fp32_units_for_expert_parallel, shard_model
from moeflow.parallel.process_group import DistributedError, Ranks, check_ranks, init
from moeflow.parallel.rank_load import fill_from_folder, parameters_on_meta, place_whole, tied_names
from moeflow.parallel.settings import ParallelSettings, training_layout_problems
from moeflow.runtime import compat
from moeflow.runtime.files import read_json
from moeflow.settings import typed
from moeflow.train.settings import TrainSettings


@dataclass(frozen=True)
class Layout:
    """How this process holds the model: its ranks (and device), how they share it (``parallel``), the
    training settings it is prepared for (``train.method: lora``: adapters; None: no training) and the
    precision FSDP's mixed precision follows."""

    ranks: Ranks
    parallel: ParallelSettings
    train: TrainSettings | None = None
    precision: str = "fp32"

    @classmethod
    def join(cls, parallel: ParallelSettings, hardware_device: str, train: TrainSettings, precision: str) -> Layout:
        """A training stage's layout: join the process group torchrun describes and check its ranks against
        ``parallel`` (moeflow.parallel.process_group)."""
        ranks = init(hardware_device, group_of_one=parallel.cpu_offload)
        return cls(ranks, check_ranks(parallel, ranks), train, precision)

    @classmethod
    def replicated(cls, ranks: Ranks, train: TrainSettings | None = None, precision: str = "fp32") -> Layout:
        """Every rank holds the whole model (``parallel.strategy: none``)."""
        return cls(ranks, typed(ParallelSettings, {"nproc_per_node": ranks.world_size}), train, precision)

    @classmethod
    def single(cls, device: str | torch.device, train: TrainSettings | None = None) -> Layout:
        """One process holding the whole model on ``device`` (evaluation stages, tests, benchmarks)."""
        return cls.replicated(Ranks(rank=0, world_size=1, local_rank=0, device=torch.device(device)), train)

    @property
    def adapters(self) -> bool:
        return self.train is not None and self.train.method == "lora"

    def weights_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the model's weights are held in: ``dtype``, except LoRA under bf16, whose frozen base is
        held in bf16 (no fp32 copy: half the memory of a 30B model's 122 GB) while peft keeps the adapters in
        fp32 (``autocast_adapter_dtype``) and a trainable router is cast back to fp32 (moeflow.model.lora)."""
        return torch.bfloat16 if self.adapters and self.precision == "bf16" else dtype


def make_model(
    settings: ModelSettings,
    *,
    experts: str | os.PathLike | None = None,
    folder: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    layout: Layout | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
    data: Sequence[str | os.PathLike] = (),
) -> torch.nn.Module:
    """The model, ready to use: loaded from ``folder``, or built from ``settings.config`` with ``vocab_size``
    token rows (deterministic for ``seed``, as LoRA's adapters' start is); in ``dtype``; for ``layout``
    (default: one process on ``device``, the CPU if not given). ``experts``: the rule's experts choice file (rule
    choose_experts), which ``model.experts_implementation: auto`` needs and any other value must be the one
    chosen for. ``data``: tokenized folders whose tokenizer the model's vocabulary must cover
    (moeflow.model.folder.check_vocabulary). ``weights=False``: no weight is read where the layout allows it
    (module docstring)."""
    layout = _placement(layout, device)
    dtype = layout.weights_dtype(dtype)
    settings = resolve_experts(settings, experts)
    _check_combination(layout, folder, settings.quantization)
    if folder is None:
        model = _built(settings, vocab_size, seed, dtype)
    else:
        model = _built_on_meta(settings, Path(folder), dtype)
    if layout.adapters and settings.quantization != "none":  # before the adapters, which read the dequantized weights
        quantize_base(model, settings.quantization, set(router_modules(model)))
    if folder is not None:
        if layout.parallel.strategy == "ep":
            if layout.adapters:  # before transformers shards the experts: their factors are split with them
                model = apply_lora(model, layout.train.lora, layout.train.gradient_checkpointing, experts_apart=True)
            model = _expert_parallel(model, settings, Path(folder), layout)
    model = install_chunked_loss(model, settings.loss_chunk_tokens)
    if layout.train is not None and layout.train.trained_mtp is not None:
        unfreeze_mtp_layers(model)  # before any forward: FSDP2 fixes its gradient dtypes at the first one
    check_vocabulary(model, list(data), folder or "the model")
    names_of = tied_names(model)
    if layout.adapters and not is_lora_model(model):
        model = apply_lora(model, layout.train.lora, layout.train.gradient_checkpointing)
    model = shard_model(model, layout.parallel, layout.ranks, layout.precision, layout.adapters)
    if folder is not None and weights:
        fill_from_folder(model, folder, names_of)
    if layout.adapters:  # whole and seeded: the same start on every rank, in every layout
        place_whole(model, initial_adapters(model, seed))
    return model


def _placement(layout: Layout | None, device: str | torch.device | None) -> Layout:
    if layout is not None and device is not None:
        raise ValueError("give make_model a layout or a device, not both (a layout's device is its ranks')")
    return layout or Layout.single(device or "cpu")


def _check_combination(layout: Layout, folder: str | os.PathLike | None, quantization: str) -> None:
    strategy = layout.parallel.strategy
    # the config check refuses these too (moeflow.parallel.settings.training_layout_problems)
    method = "lora" if layout.adapters else "full"
    lora = layout.train.lora if layout.adapters else None
    problems = training_layout_problems(
        method,
        strategy,
        layout.ranks.world_size,
        cpu_offload=layout.parallel.cpu_offload,
        lora_router=lora.router if lora else "frozen",
        lora_targets=tuple(lora.targets) if lora else (),
    )
    if lora:
        problems += quantization_problems(
            quantization, method, layout.train.gradient_checkpointing, tuple(lora.targets)
        )
    for problem in problems:
        raise DistributedError(problem)
    if strategy == "ep" and folder is None:
        raise DistributedError(
            "parallel.strategy: ep loads a saved model folder (each rank reads its experts from its files): "
            "build the model, save it, then load it"
        )


def _expert_parallel(model: torch.nn.Module, settings: ModelSettings, folder: Path, layout: Layout) -> torch.nn.Module:
    """The meta model sharded as transformers 5's ``from_pretrained`` shards it for its ``DistributedConfig``
    (``prepare_distribute_model`` then ``maybe_distribute_model``, before any weight is read): experts over
    ``ep_size`` ranks, the rest FSDP2-sharded (the routers in fp32 units of their own); its parameters still on
    the meta device."""
    _refuse_tied_embeddings_for_ep(settings, folder)
    inner = unwrap(model, peft=True)  # a LoRA model's (moeflow.model.expert_lora: its experts' factors in the plan)
    config = distributed_config(layout.parallel, layout.precision, adapters=layout.adapters, ep_plan=ep_plan(inner))
    config, _, mesh = type(inner).prepare_distribute_model(config)
    fp32_units_for_expert_parallel(inner, config, mesh)
    if config.ep_size > 1:
        split_quantized_experts(inner, config.ep_size)
    type(inner).maybe_distribute_model(inner, config, mesh)
    return model


def resolve_experts(settings: ModelSettings, choice_file: str | os.PathLike | None) -> ModelSettings:
    """``settings`` with ``experts_implementation`` from the choice file of rule choose_experts
    (moeflow.model.experts_choice), which the settings' value must be the one chosen for; without a file,
    the settings as they are (``auto`` then is an error)."""
    if choice_file is None:
        if settings.experts_implementation == AUTO_EXPERTS:
            raise ModelError(
                "model.experts_implementation is 'auto', which is resolved by measurement, and no choice was "
                "given: the stage needs rule choose_experts's choice file (results/<stack>/experts/<key>/"
                "choice.json) as its input 'experts', passed to moeflow.loading.factory.make_model as experts= "
                "(or set model.experts_implementation to eager, grouped_mm or batched_mm)"
            )
        return settings
    choice = read_json(choice_file)
    if choice["configured"] != settings.experts_implementation:
        raise ModelError(
            f"{choice_file} was chosen for model.experts_implementation {choice['configured']!r}, but this stage's "
            f"config has {settings.experts_implementation!r}: the rule's input 'experts' is another run's choice"
        )
    return dataclasses.replace(settings, experts_implementation=choice["implementation"])


def _implementations(settings: ModelSettings) -> dict[str, Any]:
    """The attention and experts implementations as transformers takes them (a resolved experts choice)."""
    kwargs: dict[str, Any] = {"attn_implementation": settings.attn_implementation}
    experts = settings.experts_implementation
    if experts is STACK_DEFAULT_EXPERTS:
        return kwargs
    if not compat.is_transformers_v5():
        if experts != "eager":  # transformers 4.57 runs its experts in a per-expert loop, the only one it has
            compat.require_transformers_v5(f"model.experts_implementation: {experts}")
        return kwargs
    return kwargs | {"experts_implementation": experts}


def _built(settings: ModelSettings, vocab_size: int | None, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    if vocab_size is None:
        raise ModelError("a model built from model.config needs its vocabulary size (the tokenizer's length)")
    config = build_config(settings.config, vocab_size)
    torch.manual_seed(seed)
    return causal_lm_class().from_config(config, torch_dtype=dtype, **_implementations(settings))


def _built_on_meta(settings: ModelSettings, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The folder's model (its config.json and generation_config.json) with parameters on the meta device
    and real buffers (rotary ``inv_freq`` is computed at construction, not read), as ``from_pretrained``
    returns it but without reading any weight."""
    from transformers import GenerationConfig

    with refusing_remote_code(folder):
        config = transformers_config(settings, folder)
        with parameters_on_meta():
            model = causal_lm_class().from_config(
                config, torch_dtype=dtype, trust_remote_code=settings.trust_remote_code, **_implementations(settings)
            )
    keep_in_fp32(model, dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return model.eval()  # as from_pretrained returns it


def fp32_names(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """The state-dict entries ``from_pretrained`` loads in float32 when asked for ``dtype``: those of the model
    class's ``_keep_in_fp32_modules`` (for float16) and ``_keep_in_fp32_modules_strict`` (float16 and
    bfloat16; DeepSeek-V3's and Step-3.5's routers), matched as each stack's ``from_pretrained`` matches them."""
    if compat.is_transformers_v5():
        from transformers.core_model_loading import build_glob_alternation

        plan = model._get_dtype_plan(dtype)  # what from_pretrained hands its loader: {pattern: torch.float32}
        if not plan:
            return set()
        pattern = build_glob_alternation(list(plan))[0]  # searched in each model key, as the loader does
        return {name for name in model.state_dict() if pattern.search(name)}
    modules = list(model._keep_in_fp32_modules or []) if dtype == torch.float16 else []
    if dtype in (torch.float16, torch.bfloat16):
        modules += list(model._keep_in_fp32_modules_strict or [])
    if not modules:
        return set()
    # transformers 4.57's from_pretrained (modeling_utils: keep_in_fp32_regex)
    pattern = re.compile("|".join(rf"((^|\.){module}($|\.))" for module in modules))
    return {name for name in model.state_dict() if pattern.search(name)}


def keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make float32 the floating-point parameters and buffers :func:`fp32_names` names, as ``from_pretrained``
    loads them (for a model built on the meta device in ``dtype``: its parameters stay on the meta device)."""
    kept = fp32_names(model, dtype)
    if not kept:
        return
    for prefix, module in model.named_modules():
        for tensors in (module._parameters, module._buffers):
            for leaf, tensor in list(tensors.items()):
                if tensor is None or not tensor.is_floating_point() or f"{prefix}.{leaf}".lstrip(".") not in kept:
                    continue
                if isinstance(tensor, torch.nn.Parameter):
                    new = torch.nn.Parameter(tensor.detach().to(torch.float32), requires_grad=tensor.requires_grad)
                    new.__dict__.update(tensor.__dict__)
                    tensors[leaf] = new
                else:
                    tensors[leaf] = tensor.to(torch.float32)


def _refuse_tied_embeddings_for_ep(settings: ModelSettings, folder: Path) -> None:
    # Measured on transformers 5.24 (tests/pipeline/test_train_distributed.py): the first step's gradients are
    # right, but the output layer and the embedding then train apart (loss 5e-4 off one process's at step 2).
    if getattr(transformers_config(settings, folder), "tie_word_embeddings", False):
        raise DistributedError(
            f"parallel.strategy: ep with a model whose embedding and output layer are tied (tie_word_embeddings in "
            f"{folder}/config.json): transformers 5's expert-parallel sharding unties them during training. Use "
            "parallel.strategy: fsdp for this model, or a model with tie_word_embeddings: false (model.config)"
        )
