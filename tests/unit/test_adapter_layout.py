"""An adapter saved on either stack loads on both with every expert's adapter, and computes what it computed where it
was saved; an adapter that lost an expert is refused, naming it (moeflow.model.adapter_layout, lora.load_adapter)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from adapter_fixtures import (
    FAMILIES,
    FIXTURES,
    STACKS,
    config_of,
    load_base,
    logits,
    this_stack,
    write_adapter,
    write_base,
)
from safetensors.torch import load_file, save_file

from moeflow.model import adapter_layout, lora
from moeflow.model.lora_merge import merge_targets

OTHER = next(s for s in STACKS if s != this_stack())


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {family: write_base(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_this_stack_still_writes_its_fixture(tmp_path, bases, family):
    """The kept adapters are what this stack's save_adapter writes today (else the other stack's test reads a stale
    layout): rerun ``python tests/adapter_fixtures.py`` here when this fails for a reason."""
    write_adapter(bases[family], family, tmp_path / "now")
    kept = FIXTURES / this_stack() / family
    assert sorted(p.name for p in (tmp_path / "now").iterdir()) == sorted(p.name for p in kept.iterdir())
    for name in ("adapter_model.safetensors", "router.safetensors"):
        if (kept / name).is_file():
            now, then = load_file(str(tmp_path / "now" / name)), load_file(str(kept / name))
            assert now.keys() == then.keys() and all(torch.equal(now[k], then[k]) for k in now), name
    for name in (lora.SETTINGS_FILE, adapter_layout.PIECES_FILE):
        if (kept / name).is_file():
            assert json.loads((tmp_path / "now" / name).read_text()) == json.loads((kept / name).read_text())
    now, then = (load_file(str(f / "logits.safetensors"))["logits"] for f in (tmp_path / "now", kept))
    torch.testing.assert_close(now, then, rtol=0, atol=1e-6)


def expert_updates(model) -> dict[str, torch.Tensor]:
    """Every routed expert's weight update, by base name and expert, whichever layout the model holds."""
    updates = {}
    for target in merge_targets(model):
        if ".experts." not in target.name and not target.name.endswith(("gate_up_proj", "down_proj")):
            continue
        if target.experts > 1:
            for e in range(target.experts):
                updates[f"{target.name}[{e}]"] = target.delta(target.lora_a, target.lora_b, e)
        else:
            updates[target.name] = target.delta(target.lora_a, target.lora_b)
    return updates


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("saved_on", STACKS)
def test_an_adapter_from_either_stack_computes_what_it_computed_there(bases, family, saved_on):
    fixture = FIXTURES / saved_on / family
    model = lora.load_adapter(load_base(bases[family]), fixture)
    expected = load_file(str(fixture / "logits.safetensors"))["logits"]
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)
    updates = expert_updates(model)
    config = config_of(family)
    moe_layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    experts = moe_layers * next(
        config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config
    )
    # one update per expert and module (gate, up, down), or per expert and fused tensor (gate_up, down)
    assert len(updates) == experts * (2 if this_stack() == "current" else 3)
    assert all(u.abs().max() > 0 for u in updates.values()), "an expert without its adapter"
    if saved_on != this_stack() and this_stack() == "current":  # per-expert gate and up: one rank-2r adapter
        ranks = {t.name: t.lora_a.shape[0] // t.experts for t in merge_targets(model) if t.experts > 1}
        assert ranks and all(r == (4 if n.endswith("gate_up_proj") else 2) for n, r in ranks.items()), ranks


def test_peft_alone_loses_the_other_stacks_experts(bases):
    """What load_adapter converts: a bare PeftModel.from_pretrained (peft's own conversion on) attaches no
    routed-expert adapter of an adapter saved on the other stack, and the logits move."""
    from peft import PeftModel

    fixture = FIXTURES / OTHER / "qwen3_moe"
    bare = PeftModel.from_pretrained(load_base(bases["qwen3_moe"]), str(fixture))
    assert not expert_updates(bare)
    assert (logits(bare) - load_file(str(fixture / "logits.safetensors"))["logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("saved_on", STACKS)
def test_an_adapter_that_lost_an_expert_is_refused_naming_it(tmp_path, bases, saved_on):
    folder = tmp_path / "adapter"
    shutil.copytree(FIXTURES / saved_on / "qwen3_moe", folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    if saved_on == "pinned":  # expert 2 of layer 1 has no adapter on its up projection
        lost = [k for k in weights if "layers.1.mlp.experts.2.up_proj." in k]
        match = "experts.2.up_proj"
    else:  # the fused gate_up adapter of layer 1
        lost = [k for k in weights if "layers.1.mlp.experts.base_layer." in k]
        match = "layers.1.mlp.experts"
    assert len(lost) == 2
    save_file({k: v for k, v in weights.items() if k not in lost}, str(folder / "adapter_model.safetensors"))
    with pytest.raises((lora.LoraConfigError, adapter_layout.AdapterLayoutError), match=match):
        lora.load_adapter(load_base(bases["qwen3_moe"]), folder)


def test_a_router_file_from_either_stack_loads(bases):
    """Mixtral's router is ``block_sparse_moe.gate`` in the files and on 4.57, ``mlp.gate`` on 5: saved under the
    files' name; a missing one is refused."""
    for stack in STACKS:
        assert all(
            "block_sparse_moe.gate" in k for k in load_file(str(FIXTURES / stack / "mixtral" / "router.safetensors"))
        )
