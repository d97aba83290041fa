"""Step-3.5-Flash (model_type ``step3p5``) as a causal LM on transformers 5's own decoder, no remote code.

transformers 5.24 ships the decoder (``Step3p7TextModel``; the auto tables map ``step3p5`` to
``Step3p7TextConfig``, which reads the published config's legacy keys) inside its multimodal step3p7, but no
causal-LM class. :class:`Step3p5ForCausalLM` is that decoder with an output layer, under the name the
published config and the serving engines use, and three changes where the shipped modules do not compute
what the published model does or what moeflow needs:

* the routed experts are :class:`Step3p5Experts`, ``Step3p7Experts`` decorated with transformers'
  ``use_experts_implementation``: ``grouped_mm`` and ``batched_mm`` really run (``Step3p7Experts`` opts out:
  ``grouped_mm`` raises at load and ``batched_mm`` silently runs the per-expert loop);
* the router is :class:`Step3p5Router`, computed in float32 at least with autocast off, as the published
  code's ``need_fp32_gate`` does (the shipped router's ``F.linear`` runs in bf16 under autocast), and honouring
  the published ``norm_expert_weight`` (the other published routing keys are refused unless they hold the values
  moeflow computes: moeflow.families.step3p5); FSDP mixed precision keeps its weight fp32 too
  (``_keep_in_fp32_modules_strict``, moeflow.parallel.layouts). The
  expert-choice bias ``e_score_correction_bias`` stays a float32 buffer (the published ``router_bias``);
* the published checkpoint's MTP layers (``model.layers.45-47``) are built and loaded with the model
  (:class:`Step3p5MTPLayer`, moeflow.families.mtp) instead of dropped.

The published weight names differ from the modules' (``moe.*`` stacked experts, ``moe.router_bias``,
``share_expert.*``): :data:`KEY_MAPPING` is registered with transformers' checkpoint-conversion mapping for
this class, so ``from_pretrained`` of a folder in the published layout has no missing or unexpected keys
and ``save_pretrained`` (and moeflow's sharded loader and export, which use the same conversion) writes the
published names back. Imported on transformers 5 only (moeflow.families.registry).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import (
    Step3p7DecoderLayer,
    Step3p7Experts,
    Step3p7PreTrainedModel,
    Step3p7RMSNorm,
    Step3p7SparseMoeBlock,
    Step3p7TextModel,
    Step3p7TopKRouter,
)
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from moeflow.families.mtp import MTPLayer, add_mtp_modules
from moeflow.families.step3p5 import routing_key_problems

ARCHITECTURE = "Step3p5ForCausalLM"  # the published config's architectures, which vLLM and SGLang select by


# The published checkpoint's names onto the decoder's modules (step3p7's own mapping without its
# ``language_model.`` prefix step); save_pretrained applies it in reverse.
KEY_MAPPING = [
    WeightRenaming(source_patterns=r"\.moe\.gate\.weight", target_patterns=".mlp.gate.weight"),
    WeightRenaming(source_patterns=r"\.moe\.router_bias", target_patterns=".mlp.gate.e_score_correction_bias"),
    WeightRenaming(source_patterns=r"\.moe\.down_proj\.weight", target_patterns=".mlp.experts.down_proj"),
    WeightRenaming(source_patterns=r"\.share_expert\.", target_patterns=".mlp.shared_experts."),
    WeightConverter(
        source_patterns=[r"moe.gate_proj.weight", r"moe.up_proj.weight"],
        target_patterns=r"mlp.experts.gate_up_proj",
        operations=[Concatenate(dim=1)],
    ),
]


@use_experts_implementation
class Step3p5Experts(Step3p7Experts):
    """``Step3p7Experts`` (stacked SwiGLU experts with clamps, its ``_apply_gate``) under transformers' experts
    implementations: the decorator dispatches ``forward`` on ``config._experts_implementation``."""


class Step3p5Router(Step3p7TopKRouter):
    """The sigmoid router with expert-choice bias, in float32 at least (float64 stays float64) with autocast
    off: logits ``h W^T``, scores ``sigmoid(logits)``, the top-k of ``scores + e_score_correction_bias`` chosen,
    their unbiased scores renormalised to sum 1 unless the published ``norm_expert_weight`` is false (the
    shipped router always renormalises; the block then scales the routed output by
    ``moe_router_scaling_factor``). Returns ``(logits, weights, index)`` as the shipped router does."""

    def __init__(self, config: Step3p7TextConfig):
        super().__init__(config)
        self.renormalise = bool(getattr(config, "norm_expert_weight", True))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        with torch.autocast(hidden_states.device.type, enabled=False):
            logits = F.linear(hidden_states.to(dtype), self.weight.to(dtype))
            scores = logits.sigmoid()
            index = torch.topk(scores + self.e_score_correction_bias.to(dtype), self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, index)
            if self.renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, index


class Step3p5MTPLayer(MTPLayer, Step3p7DecoderLayer):
    """One of the published MTP layers: a decoder layer of its own type (``mtp_layer_types``, with the head
    count of that type) and MLP (``mtp_mlp_layer_types``) plus the MTP modules (moeflow.families.mtp)."""

    def __init__(self, config: Step3p7TextConfig, mtp_config: Step3p7TextConfig, depth: int):
        super().__init__(mtp_config, depth)
        self.self_attn.config = config
        add_mtp_modules(
            self,
            config.hidden_size,
            config.vocab_size,
            lambda: Step3p7RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            head_name="output",
        )
        self.requires_grad_(False)  # carried, not trained (moeflow.families.mtp)


def mtp_config(config: Step3p7TextConfig) -> Step3p7TextConfig:
    """The config an MTP layer is built from: transformers' ``get_mtp_config`` (the MTP layers' attention and
    MLP types, indexed from 0), with the sliding layers' head count (it drops the per-layer head override) and
    no SwiGLU clamps (transformers trims the per-layer limit lists to the main layers: the MTP layers' values
    are only in the source config.json)."""
    n = config.num_nextn_predict_layers
    if config.mtp_layer_types is None or config.mtp_mlp_layer_types is None:
        raise ValueError(
            f"step3p5 config with num_nextn_predict_layers {n} but layer_types/mlp_layer_types of "
            f"{config.num_hidden_layers} entries: give {config.num_hidden_layers + n} entries (the published config's "
            "layout: the main layers, then the MTP layers), or moe_layers_enum for the MLP types"
        )
    out = config.get_mtp_config()
    out.swiglu_limits = None
    out.swiglu_limits_shared = None
    out.per_layer_config = {
        i: {"num_attention_heads": config.num_sliding_attention_heads}
        for i, kind in enumerate(out.layer_types)
        if kind == "sliding_attention"
    }
    return out


class Step3p5TextModel(Step3p7TextModel):
    """transformers' decoder with :class:`Step3p5Router`, :class:`Step3p5Experts` and the MTP layers appended
    to ``layers`` (its forward runs the first ``num_hidden_layers`` only)."""

    def __init__(self, config: Step3p7TextConfig):
        problems = routing_key_problems(config.to_dict(), "the step3p5 config")
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__(config)
        if config.num_nextn_predict_layers:
            built = mtp_config(config)
            for depth in range(config.num_nextn_predict_layers):
                self.layers.append(Step3p5MTPLayer(config, built, depth))
        for layer in self.layers:
            if isinstance(layer.mlp, Step3p7SparseMoeBlock):
                layer.mlp.gate = Step3p5Router(config)
                layer.mlp.experts = Step3p5Experts(config, swiglu_limit=_swiglu_limit(layer.mlp.experts))
        self.post_init()


class Step3p5ForCausalLM(Step3p7PreTrainedModel, GenerationMixin):
    """Step-3.5-Flash's decoder (``model``), its output layer (``lm_head``) and MTP layers (``model.layers[n:]``)."""

    config_class = Step3p7TextConfig
    config: Step3p7TextConfig
    base_model_prefix = "model"
    _no_split_modules = ["Step3p7DecoderLayer", "Step3p5MTPLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]

    def __init__(self, config: Step3p7TextConfig):
        super().__init__(config)
        self.model = Step3p5TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


def _swiglu_limit(experts: Step3p7Experts) -> float | None:
    return None if experts.limit == float("inf") else experts.limit
