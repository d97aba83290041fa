"""Step-3.5-Flash on transformers 5 without remote code (moeflow.families.step3p5): a folder in the
published layout (tests/step3p5_folder.py, written by hand) loads with no missing or unexpected keys, through
from_pretrained and moeflow's sharded loader alike; save_pretrained and the export write the published names;
the router computes in fp32 under bf16 autocast and under FSDP mixed precision (two gloo ranks); loss-free
balancing moves the fp32 expert-choice bias; the export drops in for the source folder."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from step3p5_folder import LAYERS, MOE_LAYERS, MTP, file_tensors, write_published_folder

from moeflow.checkpoint import export
from moeflow.data.collate import collate
from moeflow.data.tokenizer import train_tokenizer
from moeflow.families import registry
from moeflow.families.mtp import mtp_prefixes
from moeflow.loading.factory import Layout, make_model
from moeflow.model.routing import capture
from moeflow.model.safetensors_files import weight_files
from moeflow.model.settings import ModelSettings
from moeflow.parallel.launch import torchrun_command
from moeflow.parallel.process_group import Ranks
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.param_groups import correction_biases
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

pytestmark = pytest.mark.skipif(not compat.is_transformers_v5(), reason="Step-3.5-Flash needs transformers 5")

MODEL = {"attn_implementation": "eager", "experts_implementation": "eager", "config": {}}  # the folder's config
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer) -> Path:
    return write_published_folder(tmp_path_factory.mktemp("published") / "step3p5", len(tokenizer), tokenizer)


def expected_state(files: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors from the published ones by the published mapping, done by hand."""
    out = {}
    for name, tensor in files.items():
        if name.endswith("moe.up_proj.weight"):
            continue
        if name.endswith("moe.gate_proj.weight"):
            up = files[name.replace("gate_proj", "up_proj")]
            out[name.replace("moe.gate_proj.weight", "mlp.experts.gate_up_proj")] = torch.cat([tensor, up], dim=1)
            continue
        name = name.replace("moe.gate.weight", "mlp.gate.weight").replace(
            "moe.router_bias", "mlp.gate.e_score_correction_bias"
        )
        name = name.replace("moe.down_proj.weight", "mlp.experts.down_proj").replace(
            "share_expert.", "mlp.shared_experts."
        )
        out[name] = tensor
    return {k: v.float() for k, v in out.items()}


def batch(seed: int = 0, rows: int = 2, length: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, 300, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "position_ids": list(range(length))})
    return out


def trainer_settings(steps: int, **balance) -> TrainSettings:
    return typed(
        TrainSettings,
        training(
            {
                "steps": steps,
                "lr": 1e-2,
                "warmup_steps": 1,
                "micro_batch_size": 2,
                "balance": {"mode": "running", "coef": 0.01, **balance},
                "routing_guard": {"window_steps": 100},
                "memory_guard": {"skip_steps": 100},
            }
        ),
    )


# --------------------------------------------------------------------------- the published layout


def test_the_published_layout_loads_without_remote_code_and_saves_back(published, tmp_path):
    from transformers import AutoModelForCausalLM

    registry.register()
    assert "auto_map" not in json.loads((published / "config.json").read_text())  # no code of its own
    model, info = AutoModelForCausalLM.from_pretrained(published, output_loading_info=True, dtype=torch.float32)
    assert type(model).__name__ == "Step3p5ForCausalLM" and not any(info.values()), info
    want = expected_state(file_tensors(published))
    state = model.state_dict()
    assert sorted(state) == sorted(want) and all(torch.equal(state[n], want[n]) for n in want)
    config = model.config
    assert config.num_sliding_attention_heads == 4
    assert [layer.self_attn.num_heads for layer in model.model.layers] == [2, 4, 4, 4, 4, 4]  # MTP layers sliding
    assert config.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.5
    assert config.moe_router_scaling_factor == 3.0 and model.model.layers[3].mlp.experts.limit == 7.0
    assert mtp_prefixes(model) == tuple(f"model.layers.{LAYERS + i}." for i in range(MTP))
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    model.save_pretrained(tmp_path / "saved")
    saved, source = file_tensors(tmp_path / "saved"), file_tensors(published)
    assert sorted(saved) == sorted(source)
    assert all(torch.equal(saved[n].float(), source[n].float()) for n in source)


def test_moeflows_sharded_loader_reads_the_published_layout(published):
    """The one-rank meta build plus each rank's rows from the files (moeflow.parallel.rank_load) maps the
    published names through transformers' conversion, the stacked experts' concatenation included."""
    one_rank = Ranks(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    fsdp = Layout(one_rank, typed(ParallelSettings, {"strategy": "fsdp"}), trainer_settings(1))
    model = make_model(typed(ModelSettings, MODEL), folder=published, layout=fsdp)
    want = expected_state(file_tensors(published))
    state = model.state_dict()
    assert sorted(state) == sorted(want) and all(torch.equal(state[n], want[n]) for n in want)


# --------------------------------------------------------------------------- the router


def test_the_router_runs_in_fp32_under_bf16_autocast(published):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TopKRouter

    model = make_model(typed(ModelSettings, MODEL), folder=published).eval()
    router = model.model.layers[1].mlp.gate
    seen = {}
    router.register_forward_hook(lambda m, args, out: seen.update(h=args[0].detach(), logits=out[0]))
    ids = torch.tensor([batch()[0]["input_ids"]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), capture(model) as routing:
        model(input_ids=ids, use_cache=False)
    h = seen["h"].reshape(-1, seen["h"].shape[-1])
    assert seen["logits"].dtype == torch.float32
    torch.testing.assert_close(seen["logits"], F.linear(h.float(), router.weight.float()), rtol=0, atol=0)
    # the routing capture reports the weights the experts get: renormalised, times the routed scaling 3.0
    record = routing.layers[0]
    assert record.topk_weight.dtype == torch.float32
    torch.testing.assert_close(record.topk_weight.sum(-1), torch.full((h.shape[0],), 3.0))
    shipped = Step3p7TopKRouter(model.config)
    shipped.load_state_dict(router.state_dict())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert shipped(h)[0].dtype == torch.bfloat16  # what transformers' own router computes in


def with_config(published: Path, folder: Path, **keys) -> Path:
    """A copy of the published folder whose config.json sets ``keys``."""
    import shutil

    shutil.copytree(published, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **keys}))
    return folder


@pytest.mark.parametrize("renormalise", [True, False])
def test_norm_expert_weight_gives_the_experts_their_published_weights(published, tmp_path, renormalise):
    """#36 item 11: the published ``norm_expert_weight`` decides whether the chosen experts' sigmoid scores are
    renormalised to sum 1 before the routed scaling; false was ignored (the MoE block 40-50% off the published
    rule). The block's output against a hand computation from its own router weight, bias and experts."""
    folder = with_config(published, tmp_path / "model", norm_expert_weight=renormalise)
    model = make_model(typed(ModelSettings, MODEL), folder=folder).eval()
    block = model.model.layers[1].mlp
    h = torch.randn(10, block.gate.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scores = F.linear(h, block.gate.weight).sigmoid()
        index = torch.topk(scores + block.gate.e_score_correction_bias, block.gate.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        want = block.shared_experts(h) + 3.0 * block.experts(h, index, weights)
        got = block(h.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not renormalise or torch.allclose(weights.sum(-1), torch.ones(10))


@pytest.mark.parametrize(
    ("key", "value"), [("moe_router_activation", "softmax"), ("use_moe_router_bias", False), ("need_fp32_gate", False)]
)
def test_published_routing_keys_moeflow_does_not_compute_are_refused(published, tmp_path, key, value):
    """The other published routing keys hold the values moeflow computes, or the folder is refused at config check
    and at build, naming the key."""
    from moeflow.workflow.checks import model_type_problems

    folder = with_config(published, tmp_path / "model", **{key: value})
    (problem,) = model_type_problems(folder)
    assert f"key {key!r} is {value!r}" in problem and "config.json" in problem
    with pytest.raises(ValueError, match=f"key '{key}'"):
        make_model(typed(ModelSettings, MODEL), folder=folder)
    assert model_type_problems(published) == []


def test_loss_free_balancing_moves_the_fp32_expert_choice_bias_under_bf16(published):
    model = make_model(typed(ModelSettings, MODEL), folder=published).train()
    biases = correction_biases(model)
    assert len(biases) == len(MOE_LAYERS) and {b.dtype for b in biases} == {torch.float32}
    before = [b.clone() for b in biases]
    rate = 0.01
    trainer = Trainer(model, trainer_settings(1, coef=0.0, bias_update_rate=rate), batch(rows=4), collate_fn=collate,
                      seed=0, precision="bf16")  # fmt: skip
    trainer.run()
    for b, b0 in zip(biases, before):
        step = (b - b0) / rate
        assert b.dtype == torch.float32 and torch.allclose(step, step.round(), atol=1e-4)
        assert set(step.round().tolist()) <= {-1.0, 0.0, 1.0} and step.abs().sum() > 0
    off = make_model(typed(ModelSettings, MODEL), folder=published).train()
    Trainer(off, trainer_settings(1, coef=0.0), batch(rows=4), collate_fn=collate, seed=0, precision="bf16").run()
    assert all(torch.equal(b, b0) for b, b0 in zip(correction_biases(off), before))  # rate 0: untouched


# --------------------------------------------------------------------------- the export


def test_the_export_drops_in_for_the_published_folder(published, tokenizer, tmp_path):
    model = make_model(typed(ModelSettings, MODEL), folder=published).train()
    trainer = Trainer(model, trainer_settings(2), batch(rows=4), collate_fn=collate, seed=0)
    trainer.run()
    out = tmp_path / "export"
    export.save_final_model(model, None, out, max_shard_size="20KB", source=published)
    # the same tensors under the same names and shapes as the source folder, sharded with an index
    exported, source = file_tensors(out), file_tensors(published)
    assert {n: tuple(t.shape) for n, t in exported.items()} == {n: tuple(t.shape) for n, t in source.items()}
    assert (out / "model.safetensors.index.json").is_file() and len(set(weight_files(out).values())) > 1
    for i in range(LAYERS, LAYERS + MTP):  # the MTP layers, as they came (never trained)
        name = f"model.layers.{i}.shared_head.output.weight"
        assert torch.equal(exported[name], source[name].float())
    assert not torch.equal(
        exported["model.layers.1.moe.gate_proj.weight"], source["model.layers.1.moe.gate_proj.weight"].float()
    )
    # the source's config (legacy keys for the serving engines) and tokenizer with its chat template, as they were
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (published / name).read_bytes(), name
    assert "moe_num_experts" in json.loads((out / "config.json").read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    implementations = {"attn_implementation": "eager", "experts_implementation": "eager"}  # as trained
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **implementations).eval()
    ids = torch.tensor([batch(seed=3)[0]["input_ids"]])
    with torch.no_grad():
        want = logits(model.eval(), ids)
        torch.testing.assert_close(logits(reloaded, ids), want, rtol=0, atol=0)
        torch.testing.assert_close(
            logits(make_model(typed(ModelSettings, MODEL), folder=out), ids), want, rtol=0, atol=0
        )


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with its parameters in fresh storage: CPU kernels round differently by the alignment
    of a tensor's data (safetensors' memory map puts some at odd offsets: 2e-7 apart with the same values)."""
    for param in model.parameters():
        param.data = param.data.clone()
    return model(input_ids=ids, use_cache=False).logits


# --------------------------------------------------------------------------- FSDP mixed precision


@pytest.mark.parametrize("strategy", ["fsdp", "ep"])
def test_fsdp_mixed_precision_keeps_the_router_in_fp32(published, tmp_path, strategy):
    """Two gloo ranks, strategy fsdp (moeflow's FSDP2) or ep (transformers' expert parallelism and its FSDP2),
    precision bf16: the attention computes with bf16-gathered weights, the router with its fp32 master weights
    (its own fp32 FSDP unit; under ep transformers' one bf16 policy gathered it in bf16); a training step with
    loss-free balancing keeps the bias fp32 and moves it identically on both ranks."""
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=2))
    cmd += [__file__, str(published), str(tmp_path), strategy]
    env = {"PYTHONPATH": f"{REPO_ROOT / 'src'}:{REPO_ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, **env}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["attention_weights"] == ["torch.bfloat16"] and report["router_weights"] == ["torch.float32"]
    assert report["router_logits"] == ["torch.float32"] and report["bias_dtypes"] == ["torch.float32"]
    assert report["bias_moved"] and report["same_bias_on_both_ranks"]


def _fsdp_rank(published: str, out: str, strategy: str) -> None:
    from moeflow.model.wrappers import unwrap
    from moeflow.parallel.layouts import shard_model
    from moeflow.parallel.process_group import all_reduce_sum, process_group
    from moeflow.parallel.settings import ParallelSettings

    torch.set_num_threads(1)
    parallel = typed(
        ParallelSettings, {"nproc_per_node": 2, "strategy": strategy} | ({"ep_size": 2} if strategy == "ep" else {})
    )
    with process_group("cpu") as ranks:
        if strategy == "ep":  # sharded by transformers as it builds, then filled from the files
            layout = Layout(ranks, parallel, precision="bf16")
            model = make_model(typed(ModelSettings, MODEL), folder=published, layout=layout).train()
        else:
            model = make_model(typed(ModelSettings, MODEL), folder=published).train()
            model = shard_model(model, parallel, ranks, "bf16")
        inner = unwrap(model)
        seen = {"attention_weights": set(), "router_weights": set(), "router_logits": set()}
        inner.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
            lambda m, a: seen["attention_weights"].add(str(m.weight.dtype))
        )
        router = inner.model.layers[1].mlp.gate
        router.register_forward_pre_hook(lambda m, a: seen["router_weights"].add(str(m.weight.dtype)))
        router.register_forward_hook(lambda m, a, o: seen["router_logits"].add(str(o[0].dtype)))
        biases = correction_biases(model)
        before = [b.clone() for b in biases]
        rows = batch(seed=ranks.rank, rows=2)
        settings = trainer_settings(1, bias_update_rate=0.01)
        Trainer(model, settings, rows, collate_fn=collate, seed=0, precision="bf16").run()
        moved = any(not torch.equal(b, b0) for b, b0 in zip(biases, before))
        total = all_reduce_sum(torch.cat([b.double() for b in biases]).clone())
        same = torch.equal(total, 2 * torch.cat([b.double() for b in biases]))
        if ranks.is_main:
            report = {k: sorted(v) for k, v in seen.items()} | {
                "bias_dtypes": sorted({str(b.dtype) for b in biases}),
                "bias_moved": moved,
                "same_bias_on_both_ranks": bool(same),
            }
            (Path(out) / "rank0.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _fsdp_rank(*sys.argv[1:4])
