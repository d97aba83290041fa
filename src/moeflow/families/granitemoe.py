"""GraniteMoE: what moeflow knows about the family, and its shape from a config.

Mixtral's fields and shapes, its experts fused as ``input_linear``/``output_linear``; on 4.57 its router returns
expert-sorted gates and keeps its weight in a child ``Linear`` (``router.layer.weight``).
"""

from __future__ import annotations

from moeflow.families.family import SOFTMAX, Family
from moeflow.families.mixtral import mixtral_shape


def read_v4_granite(block, router, args, output):
    """transformers 4.57 GraniteMoE: the router returns its gates sorted by expert; undo the sort."""
    import torch

    sorted_positions, _, sorted_gates, expert_size, logits = output
    num_tokens, top_k = logits.shape[0], router.top_k
    counts = torch.as_tensor(expert_size, device=logits.device)
    sorted_experts = torch.repeat_interleave(torch.arange(len(expert_size), device=logits.device), counts)
    index = torch.empty(num_tokens * top_k, dtype=torch.long, device=logits.device)
    index[sorted_positions] = sorted_experts
    weights = torch.empty(num_tokens * top_k, dtype=sorted_gates.dtype, device=logits.device)
    weights[sorted_positions] = sorted_gates
    return logits, index.view(num_tokens, top_k), weights.view(num_tokens, top_k)


GRANITEMOE = Family(
    "granitemoe", "GraniteMoeMoE", "router", SOFTMAX, read_v4_granite, mixtral_shape, experts_one_tensor_v4=True
)
