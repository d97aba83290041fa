"""DeepSeek-V3 with its published MTP layers carried (moeflow.families.mtp), on both stacks.

The published checkpoint holds ``num_nextn_predict_layers`` (1) MTP layers as ``model.layers.61.*``:
a MoE decoder layer with ``enorm``, ``hnorm``, ``eh_proj``, its own ``embed_tokens`` and a ``shared_head``
(``norm``, ``head``). transformers' ``DeepseekV3ForCausalLM`` ignores them at load. The subclass here, under the
same class name (``save_pretrained`` records it in ``architectures``), appends them to ``model.layers`` when the
config names any, and is otherwise transformers' class unchanged (a config without MTP layers builds the same
modules, initialised alike).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as shipped
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

from moeflow.families.mtp import MTPLayer, add_mtp_modules

config_class = DeepseekV3Config


class DeepseekV3Router(shipped.DeepseekV3TopkRouter):
    """transformers' DeepSeek-V3 router with autocast off: its logits, scores and weights in float32, as the
    published code computes them (``F.linear`` on float32 inputs otherwise runs in bf16 under autocast). No state
    of its own: a built router becomes one by its class (:func:`float32_routers`), its weights kept."""

    def forward(self, hidden_states: torch.Tensor):
        with torch.autocast(hidden_states.device.type, enabled=False):
            return super().forward(hidden_states)

    @torch.no_grad()
    def get_topk_indices(self, scores: torch.Tensor) -> torch.Tensor:
        """transformers 4.57's group-limited choice (its forward calls this; 5's forward does the choice itself), with
        the experts of the groups not chosen at -inf, as DeepSeek's published code and transformers 5 put them. 4.57
        puts them at 0.0, where they win over a chosen group's expert whose score plus correction bias is below 0:
        a bias that load balancing lowered routes tokens outside the chosen groups."""
        biased = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        groups = biased.view(-1, self.n_group, self.n_routed_experts // self.n_group)
        chosen = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False)[1]
        outside = torch.ones(groups.shape[:2], dtype=torch.bool, device=groups.device).scatter_(1, chosen, False)
        candidates = groups.masked_fill(outside.unsqueeze(-1), float("-inf")).flatten(1)
        return torch.topk(candidates, k=self.top_k, dim=-1, sorted=False)[1]


def float32_routers(model: torch.nn.Module) -> None:
    """Every DeepSeek-V3 router of ``model`` computes in float32 (:class:`DeepseekV3Router`)."""
    for module in model.modules():
        if type(module) is shipped.DeepseekV3TopkRouter:
            module.__class__ = DeepseekV3Router


class DeepseekV3MTPLayer(MTPLayer, shipped.DeepseekV3DecoderLayer):
    """A published MTP layer: the decoder layer of index ``num_hidden_layers + depth`` (MoE, as layers from
    ``first_k_dense_replace`` on are) and the MTP modules."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        add_mtp_modules(
            self,
            config.hidden_size,
            config.vocab_size,
            lambda: shipped.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            head_name="head",
            own_embedding=True,
        )
        self.requires_grad_(False)  # carried, not trained (moeflow.families.mtp)


class DeepseekV3ForCausalLM(shipped.DeepseekV3ForCausalLM):
    """transformers' DeepSeek-V3 causal LM with ``num_nextn_predict_layers`` MTP layers in ``model.layers``."""

    _no_split_modules = ["DeepseekV3DecoderLayer", "DeepseekV3MTPLayer"]
    _keys_to_ignore_on_load_unexpected = None  # the MTP layers' keys are the model's own here

    def __init__(self, config: DeepseekV3Config):
        super().__init__(config)
        depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        for i in range(depth):
            self.model.layers.append(DeepseekV3MTPLayer(config, config.num_hidden_layers + i))
        if depth:
            self.post_init()
        float32_routers(self)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers 5 decides from the defining module's source whether the experts take an implementation:
        # this module defines none, transformers' DeepSeek-V3 module decorates its experts.
        return shipped.DeepseekV3ForCausalLM._can_set_experts_implementation()
