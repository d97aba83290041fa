"""The names and layout under which ``save_pretrained`` writes a model's tensors on this stack.

transformers 5 holds some weights in the model in another layout than in the files (fused experts:
``mlp.experts.gate_up_proj`` in the model, per-expert ``mlp.experts.<e>.gate_proj.weight`` and
``up_proj.weight`` in the files) and converts them when it saves (``revert_weight_conversion``) and loads;
transformers 4.57 writes the model's own names. One tensor is converted at a time, so a writer or reader
never needs more than that tensor whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeflow.runtime import compat


def saved_format(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (by the model's names) as ``save_pretrained`` writes them: file names and tensors."""
    if not compat.is_transformers_v5():
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))
