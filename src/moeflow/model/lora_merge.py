"""A LoRA model's adapted weights and their updates, for the merged export (moeflow.checkpoint.export.merged).

Each adapted weight is a :class:`MergeTarget`: peft's adapters (a ``Linear``'s, a fused expert tensor's
``ParamWrapper``) and, under expert parallelism, moeflow's own expert factors (moeflow.model.expert_lora), whose
update is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeflow.model import expert_lora
from moeflow.model import parameters as P
from moeflow.model.adapter_layout import ADAPTER_NAME


@dataclass(frozen=True)
class MergeTarget:
    """A base weight with an adapter: its name in the base model (``moeflow.model.parameters.base_name``), the
    adapter's factors as the model holds them (sharded under FSDP; peft's, or moeflow.model.expert_lora's 3-D
    (experts, r, in) and (experts, out, r) under expert parallelism) and how peft combines them (its layer's
    ``get_delta_weight``): ``experts`` is a fused expert tensor's expert count (peft's ``ParamWrapper``; 1 for a
    ``Linear`` and a 2-D parameter), ``swapped`` its (experts, out, in) layout."""

    name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    experts: int = 1
    swapped: bool = False
    fan_in_fan_out: bool = False

    def delta(self, a: torch.Tensor, b: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """The update of the base weight in fp32, from the whole factors ``a`` and ``b``; of one expert's slice of
        a fused tensor with ``expert``. peft's ``get_delta_weight`` casts it to the base's dtype before the sum,
        which rounds a small update away in a bf16 base."""
        a, b = a.float(), b.float()
        if b.dim() == 3:  # moeflow.model.expert_lora's factors
            a, b = expert_lora.peft_factors(a, b)
        if self.experts == 1:
            update = b @ a
            return (update.T if self.fan_in_fan_out else update) * self.scaling
        a = a.reshape(self.experts, -1, a.shape[-1])  # experts x rank x in
        b = b.reshape(b.shape[0], -1, self.experts)  # out x rank x experts
        if expert is None:
            return torch.einsum("ore,eri->eoi" if self.swapped else "ore,eri->eio", b, a) * self.scaling
        update = b[:, :, expert] @ a[expert]  # out x in
        return (update if self.swapped else update.T) * self.scaling


def merge_targets(model: Any) -> list[MergeTarget]:
    """Every adapted weight of a LoRA model, in module order (moeflow's expert factors after peft's adapters)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    targets = []
    for path, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or ADAPTER_NAME not in layer.lora_A:
            continue
        wrapper = isinstance(layer, ParamWrapper)
        targets.append(
            MergeTarget(
                name=P.base_name(P.clean_name(f"{path}.{layer.parameter_name if wrapper else 'weight'}")),
                lora_a=layer.lora_A[ADAPTER_NAME].weight,
                lora_b=layer.lora_B[ADAPTER_NAME].weight,
                scaling=float(layer.scaling[ADAPTER_NAME]),
                experts=layer.num_experts if wrapper else 1,
                swapped=bool(getattr(layer, "_did_swap_in_out_features", False)),
                fan_in_fan_out=bool(getattr(layer, "fan_in_fan_out", False)),
            )
        )
    for path, module in expert_lora.adapted_modules(model):
        for tensor, (scaling, transposed) in expert_lora.adapted_tensors(module).items():
            a, b = (module._parameters[name] for name in expert_lora.factor_names(tensor))
            targets.append(
                MergeTarget(
                    name=P.base_name(P.clean_name(f"{path}.{tensor}")),
                    lora_a=a,
                    lora_b=b,
                    scaling=scaling,
                    experts=a.shape[0],
                    swapped=not transposed,
                )
            )
    return targets
