"""LoRA fine-tuning through peft: which weights get adapters, saving and loading them, merging.

Settings (``train.lora``, used when ``train.method: lora``; see config/config.yaml)::

    rank, alpha, dropout           the adapters' rank r, scaling alpha / r, and dropout on their input
    targets                        attention | dense_ffn | shared_experts | routed_experts | all
    router                         frozen (default) | trainable (its full weight) | adapter (its own LoRA)

Where the adapters go is read from the model, not from a per-family table. Every ``nn.Linear`` is put in
a category by its place: under ``self_attn`` (attention), inside a routed expert (``experts.<n>.``),
inside a shared expert (``shared_expert(s).``/``share_expert.``), the router of an MoE block (found
as ``moeflow.model.routing`` finds it), or a dense MLP (``mlp.``/``feed_forward.`` outside any MoE block).
Those go to peft as ``target_modules`` (one regular expression, layer and expert indices generalised).
Routed experts stored as fused 3D parameters (transformers 5: ``mlp.experts.gate_up_proj`` and
``down_proj``, shape (experts, out, in)) go to peft as ``target_parameters``; peft then trains one
rank-r adapter per expert (``lora_A``: in -> r x experts, ``lora_B``: r x experts -> out). Under expert
parallelism they get moeflow.model.expert_lora's adapters instead (the same update, split by experts with
them), and so do a quantized base's, whose experts run one at a time (moeflow.model.quantized_experts). A
transformers 5 router is a module with a ``weight`` parameter, so a router adapter is a ``target_parameters`` entry
there and a ``target_modules`` entry on 4.57 (an ``nn.Linear``).

Limits (each raises a clear error): peft cannot apply dropout to ``target_parameters`` adapters, so
``dropout`` must be 0 when fused experts (or a transformers-5 router) get adapters; transformers 4.57
keeps only GPT-OSS's experts fused, in an (experts, in, out) layout peft cannot tell from (experts,
out, in), so LoRA on them needs transformers 5 (``compat.UnsupportedOnStack``); a router adapter on
4.57 needs an ``nn.Linear`` router, because moeflow.model.routing recomputes the DeepSeek-V3/GPT-OSS router
logits from the raw weight there.

Gradient checkpointing with frozen embeddings: the embedding output does not require grad, so the
*reentrant* checkpoint function sees no input that needs grad and returns outputs without a graph: no
gradient reaches the adapters of the checkpointed layers (tests/test_lora.py shows it). Non-reentrant
checkpointing does not have that problem, but :func:`apply_lora` calls ``enable_input_require_grads``
whenever checkpointing is on, so either variant trains the adapters.

The adapter folder holds only what training changes: ``save_pretrained`` of the peft model
(adapter_config.json, adapter_model.safetensors), the router's weights when it is trainable (router.safetensors) and
the LoRA settings (moeflow_lora.json). It is written whole from every layout: under FSDP every rank holds a share of
each adapter's rows, and :func:`adapter_state` gathers them first; under expert parallelism the routed experts'
adapters are moeflow.model.expert_lora's, saved in peft's layout and names. train_model declares it as an output
(``runs/<run>/adapter``, :func:`save_adapter_output`): the adapter, which :func:`load_adapter` loads on the base
model on either stack (moeflow.model.adapter_layout converts the routed experts' adapters), plus the trainable-parameter
report; a full run writes only the report (``method: full``). The merged
model is ``moeflow.checkpoint.export``'s: each adapted weight made whole in turn, its update (:class:`MergeTarget`)
added in fp32 and the sum rounded once to the dtype written.

Which category a weight belongs to is ``moeflow.model.parameters``' answer. This module imports peft lazily:
moeflow.plan (imported at DAG-build time) uses it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeflow.families.mtp import is_mtp_name, mtp_prefixes
from moeflow.families.registry import FAMILIES
from moeflow.model import adapter_layout, expert_lora
from moeflow.model import parameters as P
from moeflow.model.activation_checkpointing import enable_activation_checkpointing
from moeflow.model.adapter_layout import ADAPTER_NAME
from moeflow.model.quantization import quantized_weights
from moeflow.model.settings import LORA_ALL, LoraSettings
from moeflow.model.wrappers import unwrap
from moeflow.runtime import compat
from moeflow.runtime.files import atomic_dir, read_json, write_json
from moeflow.settings import typed

log = logging.getLogger("moeflow.model.lora")


SETTINGS_FILE = "moeflow_lora.json"


ROUTER_FILE = "router.safetensors"


REPORT_FILE = "trainable_parameters.json"


class LoraConfigError(ValueError):
    """A LoRA setting that cannot work for this model, naming the key and what to do."""


def is_lora_model(model: Any) -> bool:
    """True for a model wrapped by :func:`apply_lora` / :func:`load_adapter` (a peft PeftModel). Without peft
    imported no model is one: asking does not import it (134 MiB resident on the current stack, with the
    bitsandbytes it imports), which a full fine-tune's rank would otherwise carry from its export on."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def router_modules(model: Any) -> dict[str, Any]:
    """Qualified name (in the base model) -> router module of each MoE block, as moeflow.model.routing finds them."""
    base = unwrap(model, peft=True)
    family = FAMILIES.get(getattr(base.config, "model_type", None))
    if family is None:
        return {}
    mtp = mtp_prefixes(base)
    return {
        f"{name}.{family.router_attr}": getattr(module, family.router_attr)
        for name, module in base.named_modules()
        if type(module).__name__ == family.block_class
        and getattr(module, family.router_attr, None) is not None
        and not is_mtp_name(name, mtp)
    }


@dataclass
class Targets:
    """What peft gets: module names (``target_modules``) and parameter names (``target_parameters``),
    each with its category, names relative to the base model."""

    modules: dict[str, str]
    parameters: dict[str, str]


def _category_of_linear(name: str, routers: set[str], blocks: list[str]) -> str | None:
    if name in routers:
        return P.ROUTER
    category = P.module_category(name)
    if category in (P.ATTENTION, P.ROUTED_EXPERTS, P.SHARED_EXPERTS):
        return category
    if any(name.startswith(block + ".") for block in blocks):
        return None  # e.g. qwen2_moe's shared_expert_gate (hidden -> 1): not worth an adapter
    return category if category == P.DENSE_FFN else None  # not lm_head, nor anything outside the layers' projections


def find_targets(model: Any, settings: LoraSettings) -> Targets:
    """The modules and parameters that get adapters under ``settings`` (see the module docstring)."""
    routers = router_modules(model)
    blocks = sorted(name.rsplit(".", 1)[0] for name in routers)
    wanted = set(settings.categories) | ({"router"} if settings.router == "adapter" else set())
    modules: dict[str, str] = {}
    parameters: dict[str, str] = {}
    fused: list[str] = []
    base = unwrap(model, peft=True)
    mtp = mtp_prefixes(base)  # carried frozen, never run: no adapters
    for name, module in base.named_modules():
        if is_mtp_name(name, mtp):
            continue
        if isinstance(module, torch.nn.Linear):
            category = _category_of_linear(name, set(routers), blocks)
            if category in wanted:
                modules[name] = category
            continue
        if name in routers:
            if "router" in wanted:
                if not compat.is_transformers_v5():
                    raise compat.UnsupportedOnStack(
                        f"config key 'train.lora.router': an adapter on the {type(module).__name__} router needs "
                        f"transformers 5 (the 'current' stack; on {compat.version_of('transformers')} "
                        f"moeflow.model.routing "
                        "reads this router's logits from its raw weight); use router: trainable or frozen here"
                    )
                parameters[f"{name}.weight"] = "router"
            continue
        for param_name, param in _own_weights(module):
            # an ``experts`` module's 3D parameters; 4.57's GraniteMoE experts (input_linear/output_linear) are
            # not a layout peft's target_parameters reads, and get no adapters
            if param.ndim == 3 and name.endswith("experts") and P.category(f"{name}.{param_name}") == P.ROUTED_EXPERTS:
                fused.append(f"{name}.{param_name}")
                if "routed_experts" in wanted:
                    parameters[f"{name}.{param_name}"] = "routed_experts"
    if fused and "routed_experts" in wanted and not compat.is_transformers_v5():
        raise compat.UnsupportedOnStack(
            f"config key 'train.lora.targets': {getattr(unwrap(model, peft=True).config, 'model_type', '?')} "
            "keeps its routed experts as "
            f"fused 3D parameters ({fused[0]}) in an (experts, in, out) layout on transformers "
            f"{compat.version_of('transformers')}, which peft's target_parameters cannot read; LoRA on these experts "
            "needs transformers 5 (the 'current' stack). Leave routed_experts out of train.lora.targets here"
        )
    if parameters and settings.dropout:
        raise LoraConfigError(
            f"config key 'train.lora.dropout': {settings.dropout}, "
            f"but {sorted(set(parameters.values()))} are adapted through "
            f"peft's target_parameters ({next(iter(parameters))}: a fused parameter, not an nn.Linear), which cannot "
            "apply dropout. Set train.lora.dropout: 0, or leave those out of train.lora.targets"
        )
    found = set(modules.values()) | set(parameters.values())
    missing = [c for c in ([*settings.categories] if LORA_ALL not in settings.targets else []) if c not in found]
    if settings.router == "adapter" and "router" not in found:
        missing.append("router")
    if settings.router == "trainable" and not routers:
        missing.append("router")
    if missing or not found:
        raise LoraConfigError(
            f"config key 'train.lora.{'router' if missing == ['router'] else 'targets'}': model_type "
            f"{getattr(unwrap(model, peft=True).config, 'model_type', '?')} has no "
            f"{', '.join(missing) or 'adaptable weights in ' + ', '.join(settings.categories)}; "
            f"it has {', '.join(sorted(found | ({'router'} if routers else set()))) or 'none of them'}"
        )
    return Targets(modules=modules, parameters=parameters)


def _own_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters by the names it reads them by, a quantized one's (a parametrization: its codes,
    which keep the weight's number of dimensions) included."""
    chains = getattr(module, "parametrizations", {})
    return [*module.named_parameters(recurse=False), *((name, chain.original) for name, chain in chains.items())]


def module_pattern(names: list[str], exclude: tuple[str, ...] = ()) -> str:
    """One regular expression (peft full-matches it against module names) for ``names``, with layer and
    expert indices generalised so the adapter config stays short for models with thousands of experts;
    module names starting with one of ``exclude`` (the MTP layers, whose modules are named as the decoder
    layers') never match."""
    generic = {r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split(".")) for name in names}
    not_excluded = "(?!" + "|".join(re.escape(prefix) for prefix in exclude) + ")" if exclude else ""
    return not_excluded + "(?:" + "|".join(sorted(generic)) + ")"


def parameter_suffixes(names: list[str]) -> list[str]:
    """``target_parameters`` as names below the decoder layer (peft matches them as suffixes)."""
    return sorted({re.sub(r"^.*?(^|\.)layers\.\d+\.", "", name) for name in names})


@contextlib.contextmanager
def _native_layout():
    """On transformers 5, peft rewrites the targets and adapter weights of some MoE families (qwen3_moe,
    mixtral, deepseek_v3, olmoe, ...) as if they named transformers 4.57 modules, so that adapters trained
    on 4.57 still load: every ``gate_proj``/``up_proj``/``down_proj`` becomes the fused expert parameter.
    That drops the adapters of DeepSeek-V3's shared experts and dense layers. moeflow's targets are this
    model's own names (results of the two stacks never mix), so the conversion is skipped while moeflow
    creates or loads adapters."""
    if not compat.is_transformers_v5():
        yield
        return
    from peft.utils import transformers_weight_conversion as conversion

    saved = conversion.convert_peft_config_for_transformers, conversion.convert_peft_adapter_state_dict_for_transformers
    conversion.convert_peft_config_for_transformers = lambda peft_config, model, conversions=None: None
    conversion.convert_peft_adapter_state_dict_for_transformers = (
        lambda model, peft_config, adapter_state_dict, adapter_name="default": adapter_state_dict
    )
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers, conversion.convert_peft_adapter_state_dict_for_transformers = (
            saved
        )


def apply_lora(
    model: Any,
    settings: LoraSettings,
    gradient_checkpointing: bool,
    experts_apart: bool = False,
    rank_times: dict[str, int] | None = None,
) -> Any:
    """Wrap a transformers causal LM with LoRA adapters (peft) and freeze everything else; return the
    peft model. ``settings``: ``train.lora``. With ``gradient_checkpointing``
    it turns on non-reentrant checkpointing and makes the embedding output require grad. ``experts_apart``
    (expert parallelism): the fused routed-expert tensors get moeflow.model.expert_lora's factors, not peft's
    wrappers. ``rank_times``: parameter name -> a multiple of the rank and alpha its adapter gets (the same
    scaling; an adapter fused from per-expert ones, moeflow.model.adapter_layout)."""
    from peft import LoraConfig, get_peft_model

    if is_lora_model(model):
        raise LoraConfigError("the model already has LoRA adapters: apply_lora takes the base model")
    targets = find_targets(model, settings)
    quantized = quantized_weights(model)  # fused experts read one at a time (moeflow.model.quantized_experts)
    apart = sorted(
        n for n, c in targets.parameters.items() if c == "routed_experts" and (experts_apart or n in quantized)
    )
    targets.parameters = {n: c for n, c in targets.parameters.items() if n not in apart}
    if apart and not targets.modules:
        raise LoraConfigError(
            "config key 'train.lora.targets': [routed_experts] alone, with parallel.strategy: ep or a quantized "
            "base: the routed experts' adapters then go beside peft's, which need a module to adapt too. Add "
            "attention to train.lora.targets"
        )
    mtp = mtp_prefixes(unwrap(model, peft=True))
    # peft matches target_parameters as suffixes, which the MTP layers' parameters share, and a quantized weight
    # (a parametrization) only by its full name: name each in full then
    full = mtp or bool(quantized)
    parameters = sorted(targets.parameters) if full else parameter_suffixes(sorted(targets.parameters))
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        bias="none",
        target_modules=module_pattern(sorted(targets.modules), exclude=mtp) if targets.modules else [],
        target_parameters=parameters or None,
        rank_pattern={re.escape(n): settings.rank * k for n, k in (rank_times or {}).items()},
        alpha_pattern={re.escape(n): settings.alpha * k for n, k in (rank_times or {}).items()},
    )
    with _native_layout():
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    tuner = peft_model.base_model
    got_modules, got_params = set(tuner.targeted_module_names), set(getattr(tuner, "targeted_parameter_names", []))
    if got_modules != set(targets.modules) or got_params != set(targets.parameters):
        raise RuntimeError(  # the generalised pattern matched something else: a bug here, not a user error
            f"peft adapted {sorted(got_modules ^ set(targets.modules))[:5]} "
            f"/ {sorted(got_params ^ set(targets.parameters))[:5]} "
            "differently from moeflow.model.lora.find_targets"
        )
    _remove_only_lora_proxies(peft_model)
    expert_lora.add_expert_adapters(peft_model.get_base_model(), apart, settings, rank_times)
    peft_model._moeflow_expert_targets = sorted(apart) if full else parameter_suffixes(apart)
    if settings.router == "trainable":
        for router in router_modules(peft_model).values():
            router.float()  # a frozen base held in bf16: the router trains in fp32, as the adapters do
            for param in router.parameters():
                param.requires_grad_(True)
    if gradient_checkpointing:
        enable_activation_checkpointing(peft_model.get_base_model(), reentrant=False)
        peft_model.get_base_model().enable_input_require_grads()
    peft_model._moeflow_lora = settings
    return peft_model


def _remove_only_lora_proxies(model: Any) -> None:
    """peft 0.21.2's ``ParamWrapper`` adds its adapter to a parameter as a parametrization for each forward and then
    removes it; from a parameter that has another parametrization (a quantized base's) it removes only a
    ``_LoraParameterProxy``, not the ``_LoraFactorsProxy`` it uses for one adapter on fused experts, which would then
    stay and apply again at every forward. Each such wrapper removes either."""
    from peft.tuners.lora.layer import ParamWrapper

    for layer in model.modules():
        if isinstance(layer, ParamWrapper):
            layer._remove_parametrizations = functools.partial(_remove_lora_proxy, layer)


def _remove_lora_proxy(layer: Any) -> None:
    """The adapter's parametrization of ``layer``'s parameter removed, the others kept (the whole chain when it is
    the only one, as peft does)."""
    from peft.tuners.lora.layer import _LoraFactorsProxy, _LoraParameterProxy
    from torch.nn.utils import parametrize

    chain = layer.get_base_layer().parametrizations[layer.parameter_name]
    if len(chain) == 1:
        parametrize.remove_parametrizations(layer.get_base_layer(), layer.parameter_name, leave_parametrized=False)
        return
    for index in reversed(range(len(chain))):
        if isinstance(chain[index], (_LoraParameterProxy, _LoraFactorsProxy)):
            del chain[index]
            return


def initial_adapters(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's starting value, whole, by clean name: ``lora_A`` as peft draws it (Kaiming-uniform,
    ``a=sqrt(5)``) from a generator seeded with ``seed`` and taken in module order, ``lora_B`` zero (the adapted
    model starts as the base). The same on every rank and in every layout, whatever the global RNG has done;
    moeflow.loading.factory places them (a model loaded on the meta device has no values to start from)."""
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for path, layer in model.named_modules():
        if expert_lora.adapted_tensors(layer):
            out |= {P.clean_name(k): v for k, v in expert_lora.initial_factors(path, layer, generator).items()}
        if not isinstance(layer, LoraLayer) or ADAPTER_NAME not in layer.lora_A:
            continue
        a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
        start = expert_lora.lora_a_start(tuple(a.shape), generator)
        out[P.clean_name(f"{path}.lora_A.{ADAPTER_NAME}.weight")] = start.to(a.dtype)
        out[P.clean_name(f"{path}.lora_B.{ADAPTER_NAME}.weight")] = torch.zeros(tuple(b.shape), dtype=b.dtype)
    return out


def lora_settings(model: Any) -> LoraSettings:
    settings = getattr(model, "_moeflow_lora", None)
    if settings is None:
        raise LoraConfigError(
            "the model has no moeflow LoRA adapters (use moeflow.model.lora.apply_lora or load_adapter)"
        )
    return settings


def _router_state(model: Any) -> dict[str, Any]:
    return {
        f"{name}.{param_name}": param.detach().cpu().contiguous()
        for name, router in sorted(router_modules(model).items())
        for param_name, param in router.named_parameters()
    }


def adapter_state(model: Any) -> dict[str, torch.Tensor] | None:
    """What training changes (the adapters, a trainable router), whole: None for a model every rank holds whole (peft
    reads it); for a sharded one (FSDP2's DTensors) every rank's rows gathered into rank 0's host memory (the
    other ranks get an empty dict). A collective for a sharded model: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):  # FSDP2's (torch 2.3 has none)
        return None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {P.clean_name(k): v for k, v in get_model_state_dict(model, options=options).items()}


def save_adapter(model: Any, folder: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapters (peft ``save_pretrained``: adapter_config.json + adapter_model.safetensors),
    the router's weights when it is trainable, and the LoRA settings into ``folder``; ``state``: a sharded
    model's :func:`adapter_state` (None: the model's own tensors). Call it inside
    ``moeflow.runtime.files.atomic_dir`` (or a checkpoint folder that is renamed into place)."""
    from safetensors.torch import load_file, save_file

    settings = lora_settings(model)
    folder = Path(folder)
    if state is None:
        model.save_pretrained(str(folder), safe_serialization=True)
        router = _router_state(model)
    else:
        model.save_pretrained(str(folder), safe_serialization=True, state_dict=state)
        router = {P.base_name(k): v.contiguous() for k, v in state.items() if not P.is_adapter(k)}
    if getattr(model, "_moeflow_expert_targets", None):
        _add_expert_factors(model, folder, state or {P.clean_name(k): v for k, v in model.state_dict().items()})
    adapter_layout.record_pieces(model, folder, load_file(str(folder / "adapter_model.safetensors")))
    if settings.router == "trainable":  # under the files' names, which both stacks read
        names = adapter_layout.file_names(unwrap(model, peft=True), router)
        save_file({names[k]: v for k, v in router.items()}, str(folder / ROUTER_FILE))
    write_json(folder / SETTINGS_FILE, settings.as_dict())


def _add_expert_factors(model: Any, folder: Path, state: dict[str, torch.Tensor]) -> None:
    """moeflow's expert factors (moeflow.model.expert_lora), which peft's save leaves out (it saves its own layers'),
    added to the folder as one process's peft model saves its fused-expert adapters: their names, layout and
    ``target_parameters``."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    for path, module in expert_lora.adapted_modules(model):
        for tensor, wrapper in expert_lora.peft_names(P.clean_name(path), module).items():
            a, b = (state[P.clean_name(f"{path}.{name}")] for name in expert_lora.factor_names(tensor))
            weights[f"{wrapper}.lora_A.weight"], weights[f"{wrapper}.lora_B.weight"] = (
                t.contiguous() for t in expert_lora.peft_factors(a, b)
            )
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = read_json(folder / "adapter_config.json")
    config["target_parameters"] = sorted({*(config.get("target_parameters") or []), *model._moeflow_expert_targets})
    write_json(folder / "adapter_config.json", config)


def load_adapter(model: Any, folder: str | os.PathLike, gradient_checkpointing: bool = False) -> Any:
    """Adapters saved by :func:`save_adapter`, trainable. ``model``: the base model (it is wrapped as
    :func:`apply_lora` does, ``gradient_checkpointing`` as there; routed-expert adapters saved on the other stack are
    converted, moeflow.model.adapter_layout), or a model already wrapped with the same LoRA settings (resume: its
    adapter weights are replaced). Refuses an adapter tensor with no module here and an adapted weight without its
    adapter, naming them. Returns the peft model."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / SETTINGS_FILE).is_file():
        raise LoraConfigError(f"{folder} is not a moeflow LoRA adapter folder (no {SETTINGS_FILE})")
    saved = typed(LoraSettings, read_json(folder / SETTINGS_FILE))
    weights = load_peft_weights(str(folder), device="cpu")
    if not is_lora_model(model):  # an adapter saved on the other stack: its routed experts converted
        base = unwrap(model, peft=True)
        weights = adapter_layout.split_fused(weights, folder, base)
        routed = [n for n, c in find_targets(model, saved).parameters.items() if c == P.ROUTED_EXPERTS]
        weights, fused = adapter_layout.fuse_pieces(weights, base, routed, saved.rank)
        times = {name: adapter.times for name, adapter in fused.items() if adapter.times > 1}
        model = apply_lora(model, saved, gradient_checkpointing, rank_times=times)
        weights = adapter_layout.place_fused(model, weights, fused)
    elif lora_settings(model) != saved:
        raise LoraConfigError(
            f"the adapter in {folder} was trained with train.lora {saved.as_dict()}, "
            f"the model has {lora_settings(model).as_dict()}"
        )
    weights, lost = expert_lora.place_peft_factors(model, weights)
    if lost:
        raise LoraConfigError(
            f"the adapter in {folder} has no adapter for {lost[:4]}. Load it on the base model it was trained on"
        )
    with _native_layout():
        result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k and not k.endswith(expert_lora.SUFFIXES)]  # placed
    if missing or result.unexpected_keys:  # an adapter not on a module, or a module without its adapter
        raise LoraConfigError(
            f"the adapter in {folder} does not fit this model: {len(missing)} adapted weights have no adapter "
            f"there ({missing[:4]}), {len(result.unexpected_keys)} of its tensors have no module here "
            f"({list(result.unexpected_keys)[:4]}). Load it on the base model it was trained on"
        )
    if saved.router == "trainable":
        state = load_file(str(folder / ROUTER_FILE))
        routers = {f"{n}.{p}": w for n, router in router_modules(model).items() for p, w in router.named_parameters()}
        names = adapter_layout.file_names(unwrap(model, peft=True), {k: w.detach() for k, w in routers.items()})
        lost = [names[k] for k in routers if names[k] not in state and k not in state]
        if lost:
            raise LoraConfigError(f"{folder / ROUTER_FILE} has no weights for the routers {lost[:4]}")
        with torch.no_grad():
            for key, param in routers.items():
                param.copy_(state[names[key]] if names[key] in state else state[key])
    return model


def save_adapter_output(model: Any, folder: str | os.PathLike, expert_mask: Any = None) -> dict[str, Any]:
    """train_model's ``adapter`` output, written atomically by rank 0: for a LoRA model the adapter
    (:func:`save_adapter`: loadable with :func:`load_adapter` on the base model), for every model
    ``trainable_parameters.json`` (:func:`trainable_parameter_report`; ``method`` is ``full``, ``lora`` or
    ``esft``), so the output exists for a full run too. A collective for a sharded LoRA model: every rank calls it.
    Returns the report."""
    import torch.distributed as dist

    report = trainable_parameter_report(model, expert_mask)
    state = adapter_state(model) if is_lora_model(model) else None
    if dist.is_initialized() and dist.get_rank() != 0:
        return report
    with atomic_dir(folder) as tmp:
        if is_lora_model(model):
            save_adapter(model, tmp, state)
        write_json(Path(tmp) / REPORT_FILE, report)
    return report


def trainable_parameter_report(model: Any, expert_mask: Any = None) -> dict[str, Any]:
    """Trainable and total parameters (tied weights once), overall and by category (as the planner counts
    them: ``moeflow.model.parameters.counted_category``; adapters under the weight they adapt); for a LoRA model
    also the adapter parameters and the settings. ``expert_mask``: an ESFT run's (moeflow.train.expert_mask's
    ExpertMask; ``method: esft``), whose fused expert tensors train their selected rows only: the unselected rows,
    held bit-identical, are not counted as trainable."""
    frozen_rows = {}
    if expert_mask is not None:
        frozen_rows = {id(f.param): 1 - len(f.selected) / f.param.shape[0] for f in expert_mask.fused}  # whole tensors
    by_category: dict[str, dict[str, int]] = {}
    trainable = total = adapter = 0
    quantized = quantized_weights(model)
    for name, param in model.named_parameters():
        # the whole parameter's size also for an FSDP1 flat shard (moeflow.parallel.layouts.original_shape), and a
        # quantized weight's, not its stored bytes'
        dense = quantized.get(P.base_name(P.clean_name(name)))
        n = math.prod(
            dense.dequantize.packing.shape if dense else getattr(param, "_moeflow_shape", None) or param.shape
        )
        entry = by_category.setdefault(P.counted_category(name) or "other", {"trainable": 0, "total": 0})
        entry["total"] += n
        total += n
        if P.is_adapter(name):
            adapter += n
        if param.requires_grad:
            trained = n - round(n * frozen_rows.get(id(param), 0))
            entry["trainable"] += trained
            trainable += trained
    report = {
        "method": "lora" if is_lora_model(model) else "esft" if expert_mask is not None else "full",
        "trainable": trainable,
        "total": total,
        "trainable_fraction": trainable / total if total else 0.0,
        "adapter": adapter,
        "by_category": {k: by_category[k] for k in sorted(by_category)},
        "router_trainable": router_is_trainable(model),
    }
    if is_lora_model(model):
        report["lora"] = lora_settings(model).as_dict()
        report["quantization"] = next((w.dequantize.packing.kind for w in quantized.values()), "none")
    return report


def router_is_trainable(model: Any) -> bool:
    """Whether any router weight (or a router adapter) gets gradients. False for a LoRA model with a
    frozen router, a model whose routers were frozen (train.freeze_router), or a model with no router.
    With a frozen router the balancing loss cannot move the routers themselves; its gradient still
    reaches adapters upstream of them (attention and earlier layers) through the routers' input."""
    return any(p.requires_grad for router in router_modules(model).values() for p in router.parameters())


def describe(model: Any) -> str:
    """One line for the log: trainable parameters and where the adapters are."""
    r = trainable_parameter_report(model)
    parts = [f"{k} {v['trainable']:,}" for k, v in r["by_category"].items() if v["trainable"]]
    return (
        f"{r['method']}: {r['trainable']:,} of {r['total']:,} parameters trainable "
        f"({100 * r['trainable_fraction']:.2f}%): " + ", ".join(parts)
    )


__all__ = [
    "LoraSettings",
    "LoraConfigError",
    "apply_lora",
    "save_adapter",
    "load_adapter",
    "save_adapter_output",
    "adapter_state",
    "initial_adapters",
    "trainable_parameter_report",
    "router_is_trainable",
    "is_lora_model",
    "find_targets",
    "describe",
]
