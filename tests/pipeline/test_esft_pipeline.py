"""An ESFT run (train.method: esft) through the Snakefile beside the finished smoke pipeline: its routing totals and
selection are written, the exported model differs from the base model in the selected experts only (rows of the
fused tensors on transformers 5, expert modules on 4.57), and a change of the score or top_p reruns the selection
and training but not the routing pass.

The run shares the smoke pipeline's data, base model, coverage set and experts choice, so only its own plan,
routing, selection, warmup and training run (target: its model, not the paper)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import SMOKE, only_on, phases_against_plan, results, scheduled_rules, snakemake, write_overlay

pytestmark = [
    pytest.mark.pipeline,
    only_on(
        "pinned",
        "the Snakefile's ESFT wiring is the same on both; fused or separate experts: tests/unit/test_esft_training.py",
    ),
]
RUN = "esft"
ESFT = {"method": "esft", "esft": {"top_p": 0.5, "token_budget": 4096}}
_SEPARATE = re.compile(r"\.experts\.(\d+)\.")


def overlay(workdir: Path, **esft) -> str:
    train = {**ESFT, "esft": {**ESFT["esft"], **esft}}
    return write_overlay(workdir, {"runs": {RUN: {"train": train}}})


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def changed_experts(base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor]) -> tuple[set, list[str]]:
    """{(layer, expert)} whose weights changed, and every other changed tensor's name."""
    experts, others = set(), []
    for name, before in base.items():
        after = tuned[name]
        if torch.equal(before, after):
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1)) if "experts" in name else None
        separate = _SEPARATE.search(name)
        if layer is None:
            others.append(name)
        elif separate:
            experts.add((layer, int(separate.group(1))))
        else:
            rows = (before != after).flatten(1).any(dim=1).nonzero().flatten().tolist()
            experts |= {(layer, e) for e in rows}
    return experts, others


def test_an_esft_run_trains_only_its_selected_experts_and_a_top_p_change_reuses_the_routing(pipeline_copy):
    target = f"{results(pipeline_copy).relative_to(pipeline_copy)}/runs/{RUN}/model"
    change = overlay(pipeline_copy)
    snakemake(pipeline_copy, target, "--cores", "2", *SMOKE, change)
    res = results(pipeline_copy)
    (selection_file,) = res.glob("esft/selection/s-*/selection.json")
    selection = json.loads(selection_file.read_text())
    assert (selection["score"], selection["top_p"]) == ("token", 0.5) and selection["tokens"] >= 4096
    for layer in selection["layers"]:
        assert sum(layer["scores"]) == pytest.approx(1.0) and 0 < len(layer["selected"]) < len(layer["scores"])
    assert (selection_file.parent / "selection.png").stat().st_size > 0

    tuned = tensors(res / "runs" / RUN / "model")
    # the smoke pipeline's MoE base model (the other one is the dense run's)
    (base,) = [t for t in map(tensors, res.glob("base/b-*")) if t.keys() == tuned.keys()]
    experts, others = changed_experts(base, tuned)
    assert others == []  # routers, attention, norms, embeddings: bit-identical through warmup, training, export
    assert experts == {(layer["layer"], e) for layer in selection["layers"] for e in layer["selected"]}
    phases_against_plan(res / "runs" / RUN)  # every phase within the memory plan's tolerance

    assert scheduled_rules(pipeline_copy, overlay(pipeline_copy, top_p=0.6), target=target) == {
        "esft_select",
        "plan_memory",
        "warmup",
        "train_model",
    }
    rules = scheduled_rules(pipeline_copy, overlay(pipeline_copy, token_budget=2048), target=target)
    assert "esft_routing" in rules
