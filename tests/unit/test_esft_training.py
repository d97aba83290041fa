"""ESFT's masked training (moeflow.train.expert_mask.mask_experts) on a tiny qwen3_moe, whose experts are one fused
tensor per layer on transformers 5 and one module per expert on 4.57: gradients and updates reach exactly the
selected experts, everything else stays bit-identical through Trainer steps with weight decay, and the memory
planner's optimizer state is the trainable parameter count the optimizer really holds."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from gloo_ranks import SHARDED_LAYOUTS, run_ranks
from safetensors.torch import load_file
from tiny_models import FAMILIES, TRANSFORMERS_5_ONLY, build_family, tiny_model_cfg
from tiny_training import VOCAB, packed_rows, settings

from moeflow.data.collate import collate
from moeflow.families.registry import experts_fused
from moeflow.loading.factory import make_model
from moeflow.model import lora
from moeflow.model import parameters as P
from moeflow.model.routing import adapter_for
from moeflow.model.settings import ModelSettings
from moeflow.parallel import dtensors
from moeflow.plan import memory as plan
from moeflow.plan.counts import count_parameters, esft_trainable
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.expert_mask import EsftError, mask_experts
from moeflow.train.settings import EsftSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

NUM_EXPERTS = 4
SELECTED = {0: [1, 2], 1: [3]}  # the tiny model's two MoE layers
FUSED = experts_fused("qwen3_moe")
_SEPARATE = re.compile(r"(^|\.)experts\.(\d+)\.")


def selection(chosen=SELECTED, num_experts=NUM_EXPERTS) -> dict:
    uniform = [1 / num_experts] * num_experts
    return {
        "score": "token",
        "top_p": 0.2,
        "layers": [{"layer": layer, "scores": uniform, "selected": experts} for layer, experts in chosen.items()],
    }


def model(seed: int = 0):
    return make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=seed)


def esft(steps=3, weight_decay=0.1, max_grad_norm=1.0, grad_accum_steps=2, **esft_settings):
    return settings(
        method="esft",
        steps=steps,
        warmup_steps=1,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        grad_accum_steps=grad_accum_steps,
        esft=esft_settings,
    )


def pieces(tensors: dict[str, torch.Tensor]) -> dict[tuple, torch.Tensor]:
    """Every parameter split per routed expert: {(name, layer, expert): tensor} for routed-expert parameters
    (a fused tensor's row, or a separate expert's own tensor), {(name, None, None): tensor} for the rest."""
    out = {}
    for name, t in tensors.items():
        if P.category(name) not in (P.ROUTED_EXPERTS, P.EXPERT_BIASES):
            out[(name, None, None)] = t
            continue
        layer, separate = P.layer_index(name), _SEPARATE.search(name)
        if separate:
            out[(_SEPARATE.sub(r"\1experts.*.", name), layer, int(separate.group(2)))] = t
        else:
            out.update({(name, layer, e): t[e] for e in range(t.shape[0])})
    return out


def is_selected(key) -> bool:
    _, layer, expert = key
    return layer is not None and expert in SELECTED.get(layer, [])


def snapshot(m) -> dict[tuple, torch.Tensor]:
    return pieces({n: p.detach().clone() for n, p in m.named_parameters()})


def test_experts_are_fused_on_the_current_stack_and_separate_on_the_pinned_one():
    names = [n for n, _ in model().named_parameters() if P.category(n) == P.ROUTED_EXPERTS]
    assert any(_SEPARATE.search(n) for n in names) != FUSED
    assert all(bool(_SEPARATE.search(n)) != FUSED for n in names)


def test_gradients_reach_exactly_the_selected_experts_and_equal_full_training_there():
    """The masked step's gradients are full fine-tuning's on the selected experts (the same forward: the frozen
    modules change no value) and exactly zero or absent everywhere else."""
    full = Trainer(model(), settings(steps=3, warmup_steps=1), packed_rows(), collate_fn=collate, seed=0)
    full.step_gradients()
    reference = pieces({n: p.grad for n, p in full.model.named_parameters()})
    masked = Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection())
    masked.step_gradients()
    masked.expert_mask.before_step(masked.optimizer)
    grads = pieces({n: p.grad for n, p in masked.model.named_parameters()})
    chosen = [k for k in grads if is_selected(k)]
    assert len(chosen) == sum(map(len, SELECTED.values())) * (2 if FUSED else 3)  # fused: gate_up, down
    for key, grad in grads.items():
        if is_selected(key):
            assert grad.abs().sum() > 0, key
            torch.testing.assert_close(grad, reference[key], rtol=1e-5, atol=1e-7)
        else:
            assert grad is None or not grad.any(), key


def test_unselected_experts_router_and_frozen_modules_stay_bit_identical_through_steps():
    """Three Trainer steps with weight decay 0.1: only the selected experts move, on either layout."""
    trainer = Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection())
    before = snapshot(trainer.model)
    trainer.run()
    after = snapshot(trainer.model)
    categories = set()
    for key, value in after.items():
        if is_selected(key):
            assert not torch.equal(value, before[key]), f"{key} did not train"
        else:
            assert torch.equal(value, before[key]), f"{key} changed"
            categories.add(P.category(key[0]))
    assert {P.ROUTER, P.ATTENTION, P.NORMS, P.EMBEDDING, P.ROUTED_EXPERTS} <= categories


def test_configured_non_expert_modules_train_and_the_router_stays_frozen():
    trainer = Trainer(
        model(), esft(train_non_expert=True), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection()
    )
    before = snapshot(trainer.model)
    trainer.run()
    for key, value in snapshot(trainer.model).items():
        category = P.category(key[0])
        if category in (P.ATTENTION, P.EMBEDDING):
            assert not torch.equal(value, before[key]), key
        if category == P.ROUTER or (key[1] is not None and not is_selected(key)):
            assert torch.equal(value, before[key]), key


def test_selected_rows_follow_adamw_with_weight_decay_exactly_as_full_training_does():
    """One step without clipping: a selected expert's update (decoupled decay, then Adam) equals full fine-tuning's
    on the same step, where AdamW decays the whole tensor itself."""
    full = Trainer(
        model(), settings(steps=3, warmup_steps=1, max_grad_norm=0), packed_rows(), collate_fn=collate, seed=0
    )
    full.train_step()
    masked = Trainer(
        model(), esft(max_grad_norm=0), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection()
    )
    masked.train_step()
    reference, trained = snapshot(full.model), snapshot(masked.model)
    for key in filter(is_selected, trained):
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-6, atol=1e-8)


def test_optimizer_state_and_the_planners_term_are_the_trainable_parameter_count(tmp_path):
    """Separate experts: state for the selected ones only; fused: for the whole tensors (documented cost). The
    planner's optimizer term is 8 bytes (two fp32 moments) per parameter the optimizer holds state for."""
    trainer = Trainer(model(), esft(steps=1), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection())
    trainer.run()
    held = sum(p.numel() for p in trainer.optimizer.state)
    m = trainer.model
    routed = sum(p.numel() for n, p in m.named_parameters() if P.category(n) == P.ROUTED_EXPERTS)
    selected = sum(map(len, SELECTED.values()))
    assert held == (routed if FUSED else routed * selected // (NUM_EXPERTS * 2))
    assert held == sum(p.numel() for p in m.parameters() if p.requires_grad)

    cfg = tiny_model_cfg()
    shape, params, _ = count_parameters(cfg, VOCAB)
    job = plan.Job.from_settings(typed(plan.PlanMemoryStage, plan_job_settings(cfg)))
    job = dataclasses.replace(job, esft_selected=selected)
    assert esft_trainable(shape, params, job.esft, selected) == held
    assert plan.resident_state(shape, params, job)["optimizer"] == held * plan.ADAM_MOMENT_BYTES
    step = plan.memory_per_device(shape, params, job)
    assert step["optimizer"] == held * plan.ADAM_MOMENT_BYTES and step["gradients"] == held * 4

    # what train_model records for the paper's methods table: the optimizer state's bytes (the two moments, plus
    # AdamW's scalar step count per tensor), and trainable_parameters.json's method and the parameters that update
    state_bytes = trainer.optimizer_state_bytes()
    assert (
        held * plan.ADAM_MOMENT_BYTES < state_bytes <= held * plan.ADAM_MOMENT_BYTES + 8 * len(trainer.optimizer.state)
    )
    report = lora.save_adapter_output(trainer.model, tmp_path / "adapter", trainer.expert_mask)
    assert report == json.loads((tmp_path / "adapter" / lora.REPORT_FILE).read_text())
    assert report["method"] == "esft"
    assert (
        report["trainable"]
        == report["by_category"]["routed_experts"]["trainable"]
        == routed * selected // (NUM_EXPERTS * 2)
    )  # the selected experts only, also where they are rows of a fused tensor that holds state whole
    assert lora.trainable_parameter_report(trainer.model)["method"] == "full"  # no mask: not an ESFT run


def plan_job_settings(model_cfg: dict) -> dict:
    return {
        "precision": "fp32",
        "seq_len": 32,
        "vocab_size": VOCAB,
        "model": {**model_cfg, "loss_chunk_tokens": 1024, "quantization": "none"},
        "train": training({"steps": 2, "lr": 1e-3, "method": "esft"}),
        "hardware": {"device": "cpu", "num_devices": 1},
        "parallel": {"strategy": "none", "nproc_per_node": 1, "nnodes": 1, "fsdp_size": None, "ep_size": 1},
    }


def test_a_selection_of_another_model_and_a_missing_selection_are_refused():
    with pytest.raises(EsftError, match=r"names MoE layers \[5\], whose experts this model does not have"):
        Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection({5: [0]}))
    with pytest.raises(EsftError, match="the selection was made for another model"):
        Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection(num_experts=8))
    with pytest.raises(EsftError, match="needs the expert selection"):
        Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0)


def test_train_settings_carry_esft_settings_for_esft_only():
    assert training({"steps": 2, "lr": 1e-3})["esft"] is None
    assert training({"steps": 2, "lr": 1e-3, "method": "esft", "esft": {"top_p": 0.5}})["esft"] == {
        "score": "token",
        "top_p": 0.5,
        "token_budget": 262144,
        "train_shared_experts": False,
        "train_non_expert": False,
    }


def test_a_resumed_run_continues_bit_for_bit_with_the_unselected_experts_untouched(tmp_path):
    def trainer():
        return Trainer(model(), esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection())

    whole = trainer()
    before = snapshot(whole.model)
    whole.run()
    first = trainer()
    first.run(until=1)
    first.save(tmp_path / "step1")
    second = trainer()
    second.load(tmp_path / "step1")
    second.run()
    assert [r["loss"] for r in second.train_records()] == [r["loss"] for r in whole.train_records()]
    resumed, uninterrupted = snapshot(second.model), snapshot(whole.model)
    for key, value in resumed.items():
        assert torch.equal(value, uninterrupted[key]), key
        if not is_selected(key):
            assert torch.equal(value, before[key]), key


def test_the_routing_pass_is_keyed_apart_from_the_score_and_top_p():
    """A score or top_p change keys a new selection over the same routing totals; a token budget a new routing."""
    from moeflow.workflow.keys import esft_routing_key, esft_selection_key
    from moeflow.workflow.load import load

    cfg = load(REPO_ROOT / "config" / "smoke.yaml", overrides={"runs": {"moe": {"train": {"method": "esft"}}}})

    from moeflow.workflow.merge import merged_run

    cfg = merged_run(cfg, "moe")

    def with_esft(**esft):
        return {**cfg, "train": {**cfg["train"], "esft": {**cfg["train"]["esft"], **esft}}}

    for change in ({"top_p": 0.7}, {"score": "gate"}):
        assert esft_routing_key(with_esft(**change)) == esft_routing_key(cfg)
        assert esft_selection_key(with_esft(**change)) != esft_selection_key(cfg)
    assert esft_routing_key(with_esft(token_budget=1024)) != esft_routing_key(cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_only_the_selected_experts_after_a_backward_pass(family):
    """Each family's experts (separate modules, fused tensors, GPT-OSS's fused biases, DeepSeek-V3's shared expert and
    MTP layer, Step-3.5's) take the mask: after a backward pass and the mask, only expert 1 of each MoE layer has a
    non-zero gradient (where it got tokens), and nothing but routed experts trains."""
    if family in TRANSFORMERS_5_ONLY and not compat.is_transformers_v5():
        pytest.skip(f"{family} exists in transformers 5 only")
    m = build_family(family, dtype=torch.float32).train()
    adapter = adapter_for(m)
    chosen = {layer: [1] for layer in adapter.moe_layers}
    mask = mask_experts(
        m,
        typed(EsftSettings, training({"steps": 1, "lr": 1e-3, "method": "esft"})["esft"]),
        {"layers": [{"layer": layer, "scores": [0.0] * adapter.num_experts, "selected": [1]} for layer in chosen]},
    )
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(P.category(n) in (P.ROUTED_EXPERTS, P.EXPERT_BIASES) for n in trainable), trainable
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer = torch.optim.AdamW(
        mask.param_groups(
            [
                {
                    "params": [p for p in m.parameters() if p.requires_grad],
                    "weight_decay": 0.1,
                    "lr_multiplier": 1.0,
                    "name": "other",
                }
            ]
        )
    )
    mask.before_step(optimizer)
    grads = pieces({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    moved = {(layer, expert) for (_, layer, expert), g in grads.items() if g.any()}
    # an expert that got no token of this batch has a zero gradient too
    assert moved and moved <= {(layer, 1) for layer in chosen}


UNTIED = typed(ModelSettings, tiny_model_cfg(tie_word_embeddings=False))  # transformers' EP refuses tied ones


@pytest.mark.parametrize("parallel", SHARDED_LAYOUTS)
def test_two_sharded_ranks_train_the_selected_experts_as_one_process_and_resume_bit_for_bit(tmp_path, parallel):
    """ESFT on two gloo ranks (FSDP2 over fused experts on the current stack, FSDP1 over separate ones on the pinned
    one; transformers' expert parallelism, each rank holding 2 of the 4 experts, on the current one): the losses and
    the selected experts of one process taking both ranks' rows, every unselected expert, router and frozen module
    bit-identical to the base, and a run resumed from step 1's checkpoint equal bit for bit to the uninterrupted one."""
    folder = tmp_path / "model"
    make_model(UNTIED, vocab_size=VOCAB, seed=0).save_pretrained(folder)
    results = run_ranks(_esft_rank, str(tmp_path), parallel, timeout_s=300)
    # one process: both ranks' rows in one step (each rank takes micro_batch_size x grad_accum_steps rows)
    one = Trainer(
        make_model(UNTIED, folder=folder),
        esft(grad_accum_steps=4),
        packed_rows(),
        collate_fn=collate,
        seed=0,
        expert_selection=selection(),
    )
    before = snapshot(one.model)
    one.run()
    assert results["resumed_losses"] == results["losses"]
    # the planner's gradient term, per rank: the trained parameters (FSDP2, ep), whole decoder layers (FSDP1)
    cfg = tiny_model_cfg(tie_word_embeddings=False)
    job = plan_job_settings(cfg) | {"hardware": {"device": "cpu", "num_devices": 2}}
    job["parallel"] = {**job["parallel"], "nproc_per_node": 2, "ep_size": 1, **parallel}
    job = dataclasses.replace(
        plan.Job.from_settings(typed(plan.PlanMemoryStage, job)), esft_selected=sum(map(len, SELECTED.values()))
    )
    shape, params, _ = count_parameters(cfg, VOCAB)
    planned = plan.memory_per_device(shape, params, job)["gradients"] / 4
    assert abs(results["gradient_elements"] - planned) <= 8, (results["gradient_elements"], planned)  # padding
    torch.testing.assert_close(results["losses"], [r["loss"] for r in one.train_records()], rtol=1e-5, atol=0)
    sharded = pieces(load_file(tmp_path / "whole.safetensors"))
    resumed = pieces(load_file(tmp_path / "resumed.safetensors"))
    reference = snapshot(one.model)
    assert reference.keys() == sharded.keys()
    for key in reference:
        value = sharded[key]
        assert torch.equal(resumed[key], value), key
        if is_selected(key):
            # AdamW's update is about lr x sign(g): where g is nearly 0, the ranks' order of summing may flip it,
            # so the update is compared as a whole (a masked-out rank's expert would be off by its whole update)
            update = reference[key] - before[key]
            assert float((value - reference[key]).norm()) < 1e-2 * float(update.norm()), key
        else:
            assert torch.equal(value, before[key]), f"{key} changed"


def _esft_rank(rank: int, root: str, parallel: dict, results: dict) -> None:
    from gloo_ranks import gloo_group, sharded_layout
    from safetensors.torch import save_file

    from moeflow.parallel.layouts import full_state_dict

    torch.set_num_threads(1)
    with gloo_group(rank, root) as ranks:
        layout = sharded_layout(ranks, parallel)

        def trainer() -> Trainer:
            sharded = make_model(UNTIED, folder=f"{root}/model", layout=layout)
            return Trainer(sharded, esft(), packed_rows(), collate_fn=collate, seed=0, expert_selection=selection())

        whole = trainer()
        whole.run()
        first = trainer()
        first.run(until=1)
        first.save(f"{root}/step1")
        second = trainer()
        second.load(f"{root}/step1")
        second.run()
        for name, done in (("whole", whole), ("resumed", second)):
            weights, _ = full_state_dict(done.model)
            if rank == 0:
                save_file({k: v.contiguous() for k, v in weights.items()}, f"{root}/{name}.safetensors")
        whole.step_gradients()
        if rank == 0:
            results["gradient_elements"] = held_gradient_elements(whole.model)
            results["losses"] = [r["loss"] for r in whole.train_records()]
            results["resumed_losses"] = [r["loss"] for r in second.train_records()]


def held_gradient_elements(model: torch.nn.Module) -> int:
    """The gradient elements this rank holds: FSDP1's flat parameters' (a unit's gradient covers all of its
    parameters), else the parameters' local ones."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(model)
    grads = [u._handle.flat_param.grad for u in units if u._handle] if units else [p.grad for p in model.parameters()]
    return sum((g.to_local() if dtensors.is_dtensor(g) else g).numel() for g in grads if g is not None)
