"""The training loop on two CPU ranks (gloo, started by torchrun): the real Trainer and the stage scripts.

* One step's gradients through ``Trainer.step_gradients`` on 2 ranks equal one process's on the same
  global batch (relative error < 1e-5), for each balancing mode, the ranks' cross-entropy in chunks of
  tokens and the reference's in one (the full logits'), with the model whole on every rank
  (``parallel.strategy: none``), FSDP-sharded (FSDP1 on the pinned stack, FSDP2 on the current one) and,
  on the current stack, expert-parallel plus FSDP through transformers 5's DistributedConfig.
* In each layout three optimizer steps give one process's losses, and a run resumed from a checkpoint
  (gathered by every rank, written by rank 0, loaded into fresh shards) continues bit for bit.
  Expert parallelism runs a model with untied embeddings: with tied ones transformers 5 trains the
  embedding and the output layer apart, which moeflow refuses (tested below).
* The Trainer's evaluation on 2 ranks (each takes its share of the validation batches, one rank a
  filler batch to keep step with a sharded model's collective forward) gives one process's sums: the
  same row and token counts and per-expert routed tokens, loss and perplexity within 1e-6 relative.
* Warmup from a pretrained folder with ``routing_guard.reference: base`` (the base model routed without
  backward before the Trainer is built) on FSDP and, on the current stack, expert parallelism: the optimizer
  holds the shards, every parameter trains (embedding, final norm and head included), the losses are those of
  the same layout without the reference forward, and the checkpoint saves.
* LoRA under FSDP2 (current stack), fp32 and bf16, on a tiny qwen3_moe folder with fused experts, adapters on every
  target and the router: 2 ranks' losses equal one process's on the same global batch, a resumed run continues
  bit for bit, the frozen base stays bit-identical (bf16 shards, fp32 adapters), the adapter saved from the 2 ranks
  equals one process's expert by expert, and the merged export equals one process's and gives the trained logits.
* ``parallel.cpu_offload`` (FSDP2's offload policy, current stack): the shards on the host, the FSDP run's losses and
  weights exactly, a bit-for-bit resume, and the bf16 LoRA and QLoRA runs' losses; on one rank, a group of one.
* The cases of a layout share one torchrun launch (each launch starts 2 interpreters that import torch).
* Through the Snakefile: warmup and train_model of the smoke pipeline on 2 ranks complete, and a
  train_model killed with SIGKILL resumes from its checkpoint with the losses of the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a torchrun script: tiny_models, tiny_training

from conftest import only_on  # noqa: E402
from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, packed_rows  # noqa: E402

from moeflow.checkpoint.export import save_final_model
from moeflow.data.collate import collate
from moeflow.loading.factory import Layout, make_model
from moeflow.model.adapter_layout import PIECES_FILE
from moeflow.model.lora import save_adapter_output
from moeflow.model.settings import ModelSettings
from moeflow.model.wrappers import unwrap
from moeflow.parallel.dtensors import is_dtensor
from moeflow.parallel.gradients import full_gradients
from moeflow.parallel.launch import torchrun_command
from moeflow.parallel.layouts import full_state_dict, is_sharded
from moeflow.parallel.process_group import DistributedError, Ranks, check_ranks, gather_objects, init, teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.runtime import compat
from moeflow.runtime.host_copies import model_device
from moeflow.runtime.job import Job
from moeflow.runtime.stage import KILL_ENV
from moeflow.settings import REPO_ROOT, typed
from moeflow.train.guards import base_reference
from moeflow.train.settings import TrainSettings
from moeflow.train.trainer import Trainer
from moeflow.workflow.keys import training

RANKS = 2
MICRO_BATCH = 2
# balancing mode -> accumulation steps per rank. One process takes RANKS x as many micro-batches of the same
# size: the same global batch. ``running`` uses the counts accumulated so far in the step, which depend on
# the order micro-batches are seen in, so it is compared with one micro-batch per rank (counts of the whole
# step); ``exact`` and ``micro_batch`` are compared with several.
CASES = {"running": 1, "exact": 2, "micro_batch": 2}
LOSS_TERMS = ("ce", "balance", "z_loss", "label_tokens", "routed_tokens")
EVAL_ROWS = 5  # 3 batches of MICRO_BATCH rows: rank 1 evaluates one and a filler
LAYOUTS = ["none", "fsdp"] + (["ep"] if compat.is_transformers_v5() else [])
MODEL_OF_LAYOUT = {"none": "tied", "fsdp": "tied", "ep": "untied"}  # tied: embedding and output layer share weights


def settings(mode: str, accum: int, **extra) -> TrainSettings:
    return typed(
        TrainSettings,
        training(
            {
                "steps": 3,
                "lr": 3e-3,
                "min_lr": 3e-4,
                "warmup_steps": 1,
                "micro_batch_size": MICRO_BATCH,
                "grad_accum_steps": accum,
                "balance": {"mode": mode, "coef": 0.05, "z_loss_coef": 0.001},
                "routing_guard": {
                    "window_steps": 2,
                    "max_load_ratio": 3.9,
                    "min_load_entropy": 0.1,
                    "max_dead_experts": 4,
                },
                "memory_guard": {"skip_steps": 100},
                **extra,
            }
        ),
    )


def parallel(**section) -> ParallelSettings:
    """The ``parallel`` layout: the keys given, the schema's defaults for the rest."""
    return typed(ParallelSettings, section)


def parallel_section(layout: str) -> dict:
    return {"strategy": layout, "nproc_per_node": RANKS} | ({"ep_size": RANKS} if layout == "ep" else {})


# The ranks compute the cross-entropy in chunks of 24 tokens (a micro-batch of 2 x 32 tokens in 3 chunks); the
# one-process reference in a single chunk, which is the full logits' cross-entropy (tests/unit/test_linear_loss.py).
RANK_CHUNK_TOKENS = 24
REFERENCE_CHUNK_TOKENS = 4096


def make_trainer(model_dir, layout: ParallelSettings, ranks: Ranks, train_settings: TrainSettings, **kwargs) -> Trainer:
    """What the stage scripts do: load for the layout, shard, then the Trainer."""
    chunk = REFERENCE_CHUNK_TOKENS if ranks.world_size == 1 else RANK_CHUNK_TOKENS
    model_settings = typed(ModelSettings, {**tiny_model_cfg(), "loss_chunk_tokens": chunk})
    model = make_model(model_settings, folder=model_dir, layout=Layout(ranks, layout, train_settings))
    return Trainer(model, train_settings, packed_rows(), collate_fn=collate, seed=0, **kwargs)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-dist")
    folders = {}
    for kind in ("tied", "untied", "wide", "wide-untied"):
        cfg = tiny_model_cfg(**(WIDE if kind.startswith("wide") else {}))
        cfg["config"]["tie_word_embeddings"] = not kind.endswith("untied")
        folders[kind] = root / kind
        make_model(typed(ModelSettings, cfg), vocab_size=VOCAB, seed=5).save_pretrained(folders[kind])
    return folders


def one_process(model_dir: Path) -> dict:
    """One process on the ranks' global batch: per balancing mode the first step's gradients and loss
    terms, and the losses of three steps (as the ranks' straight run)."""
    ranks = init("cpu")
    out = {}
    for mode, accum in CASES.items():
        # the ranks' micro-batches one after the other (running: the ranks' single micro-batches as one)
        same_batch = (
            settings(mode, 1, micro_batch_size=MICRO_BATCH * RANKS)
            if mode == "running"
            else settings(mode, accum * RANKS)
        )
        trainer = make_trainer(model_dir, parallel(), ranks, same_batch)
        summary = trainer.step_gradients()
        out[mode] = (full_gradients(trainer.model), {k: summary[k] for k in LOSS_TERMS})
    run = make_trainer(model_dir, parallel(), ranks, settings("running", 1, micro_batch_size=MICRO_BATCH * RANKS))
    run.run()
    out["losses"] = [r["loss"] for r in run.train_records()]
    out["eval"] = evaluation(model_dir, parallel(), ranks)
    return out


def evaluation(model_dir, layout: ParallelSettings, ranks: Ranks) -> dict:
    """The Trainer's evaluation sums of the saved model over the validation rows (on every rank)."""
    trainer = make_trainer(model_dir, layout, ranks, settings("running", 1), eval_rows=packed_rows(EVAL_ROWS, seed=1))
    stats = trainer.evaluation_stats()
    record = trainer.evaluate()
    return {
        "loss": record["loss"],
        "perplexity": record["perplexity"],
        "label_tokens": record["label_tokens"],
        "sequences": stats.sequences,
        "input_tokens": stats.input_tokens,
        "routed": stats.routed.tolist(),
        "served_loss_sum": stats.served_loss_sum.ravel().tolist(),
    }


def run_ranks(saved_model: Path, out: Path, layout: str, parts: tuple[str, ...]) -> None:
    """One torchrun launch of 2 ranks running ``parts`` (names of PARTS) one after the other in one process group;
    each part writes ``out/<part>/report.json``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop(KILL_ENV, None)
    cmd = shlex.split(torchrun_command(sys.executable, cpu_ranks=RANKS)) + [
        __file__,
        str(saved_model),
        str(out),
        json.dumps(parallel_section(layout)),
        ",".join(parts),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


SHARDED_LAYOUTS = ["fsdp"] + (["ep"] if compat.is_transformers_v5() else [])
LORA_ON_FSDP = compat.fsdp2_available()  # FSDP1 refuses LoRA (one dtype per unit), tested below


@pytest.fixture(scope="module")
def launched(saved_models, tmp_path_factory):
    """A layout's rank reports, from one torchrun launch per layout (for CI's time: a launch starts 2 interpreters
    that import torch and transformers): the steps and, for a sharded layout, the base-reference warmup too."""
    folders = {}

    def launch(layout: str) -> Path:
        if layout not in folders:
            out = tmp_path_factory.mktemp(f"ranks-{layout}")
            parts = ("steps", "base-reference") if layout in SHARDED_LAYOUTS else ("steps",)
            parts += ("lora", "offload") if layout == "fsdp" and LORA_ON_FSDP else ()
            parts += ("lora",) if layout == "ep" else ()
            run_ranks(saved_models[MODEL_OF_LAYOUT[layout]], out, layout, parts)
            folders[layout] = out
        return folders[layout]

    return launch


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    diff = torch.sqrt(sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want))
    return float(diff / torch.sqrt(sum((want[n].double() ** 2).sum() for n in want)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_through_the_trainer_give_one_process_steps_and_resume_exactly(saved_models, launched, layout):
    from safetensors.torch import load_file

    reference = one_process(saved_models[MODEL_OF_LAYOUT[layout]])
    out = launched(layout) / "steps"
    report = json.loads((out / "report.json").read_text())
    for mode in CASES:
        want_grads, want_terms = reference[mode]
        error = relative_error(load_file(str(out / f"grads-{mode}.safetensors")), want_grads)
        print(f"{layout} {mode}: relative gradient error vs one process {error:.1e}")  # shown with pytest -s
        assert error < 1e-5, (mode, error)
        got_terms = report["terms"][mode]
        assert (
            got_terms["label_tokens"] == want_terms["label_tokens"]
            and got_terms["routed_tokens"] == want_terms["routed_tokens"]
        )
        for term in ("ce", "balance", "z_loss"):  # the logged loss is the global one, on every rank
            assert got_terms[term] == pytest.approx(want_terms[term], rel=1e-6), (mode, term)
        assert report["terms_rank1"][mode] == got_terms
    assert report["sharded"] == (layout != "none")
    resumed = report["resume"]
    assert [loss for _, loss, _ in resumed["straight"]] == pytest.approx(reference["losses"], rel=1e-5)
    assert resumed["continued_from"] == 2 and resumed["straight"] == resumed["resumed"]
    assert resumed["same_weights"]
    assert report["mfu"] == pytest.approx(report["flops_per_s"] / (1e12 * RANKS))
    want_eval = reference["eval"]
    for rank_eval in report["eval"]:  # every rank has the whole set's result
        for key in ("label_tokens", "sequences", "input_tokens", "routed"):
            assert rank_eval[key] == want_eval[key], key
        for key in ("loss", "perplexity"):
            assert rank_eval[key] == pytest.approx(want_eval[key], rel=1e-6), key
        assert rank_eval["served_loss_sum"] == pytest.approx(want_eval["served_loss_sum"], rel=1e-6)
    assert want_eval["sequences"] == EVAL_ROWS


@pytest.mark.parametrize("layout", SHARDED_LAYOUTS)
def test_warmup_from_a_folder_with_the_base_reference_trains_the_shards(launched, layout):
    """The warmup stage's order (moeflow's workflow/scripts/warmup.py): the model from a pretrained folder, the
    base model's routing reference (a forward without backward), then the Trainer and its checkpoint. FSDP2
    keeps the root unit gathered after that forward; an optimizer built over the gathered parameters leaves
    the embedding, final norm and head untrained and the real gradients never zeroed."""
    report = json.loads((launched(layout) / "base-reference" / "report.json").read_text())
    experts = tiny_model_cfg()["config"]["num_experts"]
    assert report["reference_experts"] == [experts, experts]  # the load of both MoE layers' every expert
    assert report["optimizer_holds_the_parameters"], report
    assert report["untrained"] == [], report["untrained"]
    assert report["with_reference"] == report["without_reference"]  # the losses and gradient norms, exactly
    assert report["saved"]


# Adapters on every target, the router's included (a target_parameters adapter on transformers 5's router).
LORA = {"method": "lora", "gradient_checkpointing": True, "lora": {"rank": 4, "targets": ["all"], "router": "adapter"}}
# case: (precision, model.quantization); a quantized base on the wide model (4-bit blocks of 32 need its widths)
LORA_CASES = {
    "fp32": ("fp32", "none"),
    "bf16": ("bf16", "none"),
    "nf4-bf16": ("bf16", "nf4"),
    "nf4-fp32": ("fp32", "nf4"),
}
WIDE = {"hidden_size": 64, "moe_intermediate_size": 32, "head_dim": 16, "num_attention_heads": 4}


# Losses against one process: FSDP sums a step's terms in one process's order; expert parallelism sends the tokens
# to their experts' ranks and back, and sums them in another (the issue's bound)
LOSS_TOLERANCE = {"fsdp": 1e-6, "ep": 1e-5}
# The layouts LoRA runs in over 2 ranks, with their cases: expert parallelism splits the experts' adapters with the
# experts (moeflow.model.expert_lora), over a model with untied embeddings, its router frozen (an adapter is refused
# there); a quantized base's stored bytes split by experts too (moeflow.model.quantized_experts).
LORA_LAYOUT_CASES = [("fsdp", case) for case in ("fp32", "bf16", "nf4-bf16")] + [("ep", case) for case in LORA_CASES]


def lora_folder(folders: Path, case: str, layout: str = "fsdp") -> Path:
    """The saved model a case trains: ``folders`` holds them all (the ``saved_models`` fixture's)."""
    if LORA_CASES[case][1] != "none":
        return folders / ("wide-untied" if layout == "ep" else "wide")
    return folders / MODEL_OF_LAYOUT[layout]


# Under expert parallelism the bf16 QLoRA case adapts attention only: a quantized experts module with no adapters of
# its own (no tensor of its own for transformers to split) still gets each rank's expert count before its tokens are
# dispatched (moeflow.model.quantized_experts.split_quantized_experts); the fp32 case adapts every target.
EP_TARGETS = {"nf4-bf16": ["attention"]}


def lora_section(layout: str, case: str = "fp32") -> dict:
    """LORA, with the router frozen under expert parallelism (and there the case's targets)."""
    if layout != "ep":
        return LORA
    return LORA | {"lora": LORA["lora"] | {"router": "frozen", "targets": EP_TARGETS.get(case, ["all"])}}


def lora_trainer(
    model_dir,
    layout: ParallelSettings,
    ranks: Ranks,
    case: str,
    checkpoint_dir: Path | None = None,
    adapters_of: str | None = None,
) -> Trainer:
    """A LoRA run of MICRO_BATCH rows per micro-batch and RANKS of them per step over the ranks (``exact``
    balancing: the step's counts, whatever rank a row is on), the cross-entropy in the same chunks everywhere;
    with a checkpoint after every step into ``checkpoint_dir``; with the LoRA settings of the layout
    ``adapters_of`` (default: ``layout``'s)."""
    precision, quantization = LORA_CASES[case]
    section = lora_section(adapters_of or layout.strategy, case)
    train = settings("exact", RANKS // ranks.world_size, **section, checkpoint_every=1 if checkpoint_dir else 0)
    cfg = tiny_model_cfg(**(WIDE if quantization != "none" else {}))
    model_settings = typed(ModelSettings, {**cfg, "loss_chunk_tokens": RANK_CHUNK_TOKENS, "quantization": quantization})
    model = make_model(model_settings, folder=model_dir, layout=Layout(ranks, layout, train, precision))
    return Trainer(
        model, train, packed_rows(), collate_fn=collate, seed=0, precision=precision, checkpoint_dir=checkpoint_dir
    )


def lora_outputs(trainer: Trainer, out: Path, model_dir) -> None:
    """What train_model writes of a LoRA run (every rank calls both): the adapter, then the merged model."""
    save_adapter_output(unwrap(trainer.model), out / "adapter")
    save_final_model(trainer.model, None, out / "merged", "5GB", source=model_dir)


def expert_pieces(name: str, tensor: torch.Tensor, experts: int) -> dict[str, torch.Tensor]:
    """An adapter tensor by expert where it adapts fused experts (peft's layout: ``lora_A`` rows expert-major,
    ``lora_B`` columns rank-major), else whole."""
    if ".mlp.experts." not in name:
        return {name: tensor}
    if ".lora_A." in name:
        return {f"{name}[expert {e}]": rows for e, rows in enumerate(tensor.reshape(experts, -1, tensor.shape[-1]))}
    columns = tensor.reshape(tensor.shape[0], -1, experts)
    return {f"{name}[expert {e}]": columns[:, :, e] for e in range(experts)}


@pytest.mark.skipif(not LORA_ON_FSDP, reason="LoRA under FSDP needs FSDP2 (the current stack); FSDP1 refuses it")
@pytest.mark.parametrize("layout,case", LORA_LAYOUT_CASES)
def test_lora_on_two_ranks_gives_one_process_adapters_and_merged_model(saved_models, launched, tmp_path, layout, case):
    """LoRA and QLoRA (an NF4 base) under FSDP2, and LoRA under expert parallelism, against one process: the losses,
    the resume, the frozen base (held in bf16, or as 4-bit codes), the adapter file expert by expert, and the merged
    model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    precision, quantization = LORA_CASES[case]
    report = json.loads((launched(layout) / "lora" / "report.json").read_text())[case]
    ranks_out = launched(layout) / "lora" / case
    folder = lora_folder(saved_models["tied"].parent, case, layout)
    one = lora_trainer(folder, parallel(), init("cpu"), case, adapters_of=layout)
    one.run()
    lora_outputs(one, tmp_path, folder)
    want = [r["loss"] for r in one.train_records()]
    assert [loss for _, loss, _ in report["straight"]] == pytest.approx(want, rel=LOSS_TOLERANCE[layout])
    assert report["continued_from"] == 2 and report["resumed"] == report["straight"]
    assert report["frozen_unchanged"] and report["trained"] == report["adapters"] != []
    held = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[precision]
    assert report["dtypes"] == {
        "frozen": sorted({held} | ({"torch.uint8"} if quantization != "none" else set())),
        "adapters": ["torch.float32"],
    }
    assert report["sharded"]

    experts = tiny_model_cfg()["config"]["num_experts"]
    got = load_file(str(ranks_out / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    adapted_experts = layout != "ep" or case not in EP_TARGETS
    assert sorted(got) == sorted(reference) and any(".mlp.experts." in k for k in got) == adapted_experts
    # which file module each fused row is, for a reader on transformers 4.57 (moeflow.model.adapter_layout)
    pieces_file = [folder / "adapter" / PIECES_FILE for folder in (ranks_out, tmp_path)]
    assert pieces_file[0].is_file() == pieces_file[1].is_file() == adapted_experts
    if adapted_experts:
        assert json.loads(pieces_file[0].read_text()) == json.loads(pieces_file[1].read_text())
    if layout == "ep" and precision == "bf16":
        # The experts' bf16 outputs come back from their ranks and are combined in another order, so near-tied
        # router scores can pick another expert for a token, and AdamW's normalised step turns rounding into a sign
        # on the smallest gradients: an adapter's update differed from one process's by up to 14% (layer 1's
        # experts). The losses above agree within 1e-5; the fp32 case compares the values expert by expert.
        return
    # Expert parallelism sums a gradient in another order. Over a quantized base (moeflow.model.quantized_experts), one
    # element of one expert's factor differed from one process's by 1.6e-6 to 2.7e-6 in fp32, another element in each
    # launch; 1e-5 is a tenth of a percent of three steps' update (lr 3e-3), and a lost expert's rows are off by 1e-2.
    atol = (1e-5 if quantization != "none" else 1e-6) if layout == "ep" else 1e-7
    for name in reference:
        pieces, want_pieces = expert_pieces(name, got[name], experts), expert_pieces(name, reference[name], experts)
        for piece, tensor in want_pieces.items():
            torch.testing.assert_close(pieces[piece], tensor, rtol=1e-5, atol=atol, msg=lambda m, p=piece: f"{p}: {m}")

    merged = AutoModelForCausalLM.from_pretrained(ranks_out / "merged", local_files_only=True)
    alone = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    ulp = 2**-7 if precision == "bf16" else 1e-5  # a bf16 weight whose sum with its update rounds the other way
    merged_atol = atol if layout == "ep" and quantization != "none" else 1e-7  # the factors' difference, above
    for name, tensor in alone.state_dict().items():
        torch.testing.assert_close(
            merged.state_dict()[name], tensor, rtol=ulp, atol=merged_atol, msg=lambda m, n=name: f"{n}: {m}"
        )
    if precision == "fp32":  # the merged folder computes what the trained adapters do
        x = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            trained = one.model(input_ids=x).logits
            torch.testing.assert_close(merged(input_ids=x).logits, trained, rtol=0, atol=1e-5)


@pytest.mark.skipif(not LORA_ON_FSDP, reason="parallel.cpu_offload needs FSDP2 (the current stack); refused on FSDP1")
def test_cpu_offload_on_two_fsdp_ranks_trains_and_resumes_as_fsdp_does(launched):
    """``parallel.cpu_offload`` (FSDP2's offload policy) on 2 ranks: every shard a DTensor on the host, the model's
    compute device recorded; a full fine-tune gives the FSDP run's losses, gradient norms and weights exactly and
    resumes bit for bit, and bf16 LoRA and QLoRA (NF4) runs give those runs' losses."""
    out = launched("fsdp")
    report = json.loads((out / "offload" / "report.json").read_text())
    steps = json.loads((out / "steps" / "report.json").read_text())
    lora = json.loads((out / "lora" / "report.json").read_text())
    assert report["parameters"] == {"devices": ["cpu"], "dtensors": True, "offloaded": True, "compute": "cpu"}
    assert report["straight"] == steps["resume"]["straight"]
    assert report["continued_from"] == 2 and report["resumed"] == report["straight"]
    assert report["same_weights"]
    assert report["lora"] == {case: lora[case]["straight"] for case in ("bf16", "nf4-bf16")}


@pytest.mark.skipif(not LORA_ON_FSDP, reason="parallel.cpu_offload needs FSDP2 (the current stack); refused on FSDP1")
def test_cpu_offload_on_one_rank_shards_over_a_group_of_one_and_gives_one_process_steps(saved_models, tmp_path):
    """One process started without torchrun (as the training rule starts one rank) with ``cpu_offload`` joins a group
    of its own, offloads every unit and gives the unsharded run's losses."""
    section = {"strategy": "fsdp", "nproc_per_node": 1, "cpu_offload": True}
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", KILL_ENV):
        env.pop(key, None)
    cmd = [sys.executable, __file__, str(saved_models["tied"]), str(tmp_path), json.dumps(section), "offload-alone"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "offload-alone" / "report.json").read_text())
    alone = make_trainer(
        saved_models["tied"], parallel(), init("cpu"), settings("running", 1, micro_batch_size=MICRO_BATCH * RANKS)
    )
    alone.run()
    assert report["losses"] == pytest.approx([r["loss"] for r in alone.train_records()], rel=1e-6)
    assert report["parameters"] == {"devices": ["cpu"], "dtensors": True, "offloaded": True, "compute": "cpu"}


def test_mfu_is_logged_against_a_known_peak_and_null_without(saved_models):
    ranks = init("cpu")
    unknown = make_trainer(saved_models["tied"], parallel(), ranks, settings("running", 1, steps=1))
    unknown.run()
    assert unknown.train_records()[-1]["mfu"] is None
    known = make_trainer(
        saved_models["tied"], parallel(), ranks, settings("running", 1, steps=1, peak_flops_per_s=2.0e12)
    )
    known.run()
    record = known.train_records()[-1]
    assert record["mfu"] == pytest.approx(record["flops_per_s"] / 2.0e12) and 0 < record["mfu"] < 1


def test_lora_where_it_cannot_run_is_refused_naming_the_settings(saved_models):
    """A router adapter under expert parallelism (peft's wrapper would move the router out of the plan's names) and
    LoRA under FSDP1 (pinned stack), where the model is loaded as at config check."""
    two = Ranks(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    refused = {"ep": ("untied", {"ep_size": 2}, "'train.lora.router': adapter and 'parallel.strategy': ep")}
    if not compat.fsdp2_available():
        refused["fsdp"] = ("tied", {}, "'train.method': lora and 'parallel.strategy': fsdp")
    for strategy, (model, extra, message) in refused.items():
        layout = parallel(strategy=strategy, nproc_per_node=2, **extra)
        lora = {"method": "lora", "lora": {"router": "adapter"}}
        with pytest.raises(DistributedError, match=message):
            make_model(
                typed(ModelSettings, tiny_model_cfg()),
                folder=saved_models[model],
                layout=Layout(two, layout, settings("running", 1, **lora)),
            )


@pytest.mark.skipif(not compat.is_transformers_v5(), reason="expert parallelism is transformers 5 only")
def test_expert_parallelism_refuses_tied_embeddings(saved_models):
    two = Ranks(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    ep = Layout(two, parallel(strategy="ep", ep_size=2, nproc_per_node=2))
    with pytest.raises(DistributedError, match="tie_word_embeddings.*parallel.strategy: fsdp"):
        make_model(typed(ModelSettings, tiny_model_cfg()), folder=saved_models["tied"], layout=ep)


def test_ranks_that_differ_from_the_config_are_a_clear_error():
    one = Ranks(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(DistributedError, match="torchrun started 1 rank.*ask for 2"):
        check_ranks(parallel(strategy="none", nproc_per_node=2), one)


def test_ranks_share_the_rules_threads_and_only_rank_0_writes_the_log(monkeypatch):
    argv = [
        "--job",
        json.dumps({"rule": "warmup", "input": {}, "output": {}, "params": {}}),
        "--threads",
        "8",
        "--log-file",
        "w.log",
    ]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert (Job.from_argv(argv=argv).threads, Job.from_argv(argv=argv).log_file) == (4, "w.log")
    monkeypatch.setenv("RANK", "1")
    assert Job.from_argv(argv=argv).log_file is None


# --------------------------------------------------------------------------- through Snakemake (smoke config)


@pytest.mark.pipeline
@only_on(
    "pinned",
    "the rule's wiring is the same on both; the exact two-rank resume: the tests above (current runs the two-rank "
    "QLoRA pipeline, tests/pipeline/test_lora_pipeline.py)",
)
def test_two_rank_training_stages_through_the_snakefile_complete_and_resume_after_a_kill(pipeline_copy):
    from conftest import active_stack, executed_rules, snakemake

    results = pipeline_copy / "results" / active_stack()
    target = f"results/{active_stack()}/runs/moe/model"
    # 2 threads for the training rules (the smoke config's 1 would hide how the node's ranks share them), set as a
    # profile sets them: the config key `threads` is every torch rule's param, and changing it would rerun the base
    # model and the coverage pass too. The coverage pass keeps its one-rank layout (coverage.strategy null would
    # follow parallel's and run it again, same bytes).
    two_ranks = {
        "parallel": {"nproc_per_node": RANKS, "strategy": "fsdp"},
        "hardware": {"num_devices": RANKS},
        "coverage": {"strategy": "none"},
    }
    (pipeline_copy / "config" / "ranks.yaml").write_text(json.dumps(two_ranks))
    threads = ("--set-threads", f"warmup={RANKS}", f"train_model={RANKS}")
    args = ("--cores", "2", *threads, "--configfile", "config/smoke.yaml", "config/ranks.yaml")
    # the training stages and the memory plan, which plans for the devices; and the run's experts choice, timed in
    # the layout training runs (#24 item 11). Not the base model, its experts choice or its coverage pass: the base
    # does not depend on the run's layout. Read from the run's own job table: a dry run before it would cost a
    # Snakemake start of CI time.
    rules = executed_rules(snakemake(pipeline_copy, target, *args))
    expected = {"plan_memory", "warmup", "train_model", "choose_experts"}
    assert rules == expected, rules
    metrics = results / "runs" / "moe" / "train" / "metrics.jsonl"
    straight = [json.loads(x) for x in metrics.read_text().splitlines()]
    log = (results / "logs" / "train_model" / "moe.log").read_text()
    assert "threads=1" in log  # the rule's 2 threads shared by the node's 2 ranks
    summary = json.loads((results / "runs" / "moe" / "train" / "summary.json").read_text())
    assert summary["steps"] == 8

    # rerun train_model and kill every rank with SIGKILL after step 6's checkpoint; then resume it
    killed = snakemake(
        pipeline_copy, target, *args, "--forcerun", "train_model", check=False, env={KILL_ENV: "train_model.step6"}
    )
    assert killed.returncode != 0 and executed_rules(killed) == {"train_model"}
    checkpoints = list((results / "checkpoints").glob("train_model-*/step-00000006"))
    assert len(checkpoints) == 1
    assert executed_rules(snakemake(pipeline_copy, target, *args, "--rerun-incomplete")) == {"train_model"}
    log = (results / "logs" / "train_model" / "moe.log").read_text()
    assert "step-00000006 at step 6" in log
    resumed = [json.loads(x) for x in metrics.read_text().splitlines()]
    train_losses = lambda records: [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]  # noqa: E731
    assert train_losses(resumed) == train_losses(straight) and len(train_losses(resumed)) == 8
    assert not checkpoints[0].parent.exists()
    # the final model, gathered from the FSDP shards, is a whole model with the base model's parameters
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(results / "runs" / "moe" / "model").state_dict()
    shapes = lambda state: {k: tuple(v.shape) for k, v in state.items()}  # noqa: E731
    bases = [AutoModelForCausalLM.from_pretrained(d).state_dict() for d in sorted((results / "base").glob("b-*"))]
    (base,) = [b for b in bases if shapes(b) == shapes(final)]  # the MoE's base (the dense run has its own)
    assert not all(torch.equal(base[k], final[k]) for k in base)


# --------------------------------------------------------------------------- one rank (run by torchrun)


def _steps(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> None:
    """Per balancing mode: one step's gradients and loss terms; then a run resumed from its checkpoint
    against the same run straight through. Rank 0 writes what it found under ``out``."""
    from safetensors.torch import save_file

    report: dict = {"terms": {}, "terms_rank1": {}}
    for mode, accum in CASES.items():
        trainer = make_trainer(model_dir, layout, ranks, settings(mode, accum))
        summary = trainer.step_gradients()
        grads = full_gradients(trainer.model)
        terms = gather_objects({k: summary[k] for k in LOSS_TERMS})
        report["terms"][mode], report["terms_rank1"][mode] = terms
        if ranks.is_main:
            save_file({k: v.contiguous() for k, v in grads.items()}, str(out / f"grads-{mode}.safetensors"))
    report["sharded"] = is_sharded(trainer.model)
    report["eval"] = gather_objects(evaluation(model_dir, layout, ranks))

    straight, report["resume"] = straight_and_resumed(model_dir, out, ranks, layout)
    record = straight.train_records()[-1]
    report["mfu"], report["flops_per_s"] = record["mfu"], record["flops_per_s"]
    if ranks.is_main:
        (out / "report.json").write_text(json.dumps(report))


def records(trainer: Trainer) -> list[tuple[int, float, float]]:
    """(step, loss, gradient norm) of each of a run's training steps."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.train_records()]


def straight_and_resumed(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> tuple[Trainer, dict]:
    """Three steps straight through with a checkpoint after each, then a run resumed from the newest: the straight
    run, and what both did."""
    with_peak = settings("running", 1, checkpoint_every=1, peak_flops_per_s=1e12)
    straight = make_trainer(model_dir, layout, ranks, with_peak, checkpoint_dir=out / "checkpoints")
    straight.run()  # checkpoints after steps 1 and 2 (only the newest is kept)
    resumed = make_trainer(model_dir, layout, ranks, with_peak, checkpoint_dir=out / "checkpoints")
    assert resumed.resume()
    continued_from = resumed.step
    resumed.run()
    weights = [full_state_dict(t.model)[0] for t in (straight, resumed)]
    return straight, {
        "continued_from": continued_from,
        "straight": records(straight),
        "resumed": records(resumed),
        "same_weights": sorted(weights[0]) == sorted(weights[1])
        and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]),
    }


def _base_reference(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> None:
    """Warmup's order on this rank, with and without the base reference forward before the Trainer."""
    s = settings("running", 1)
    runs, report = {}, {}
    for with_reference in (True, False):
        model_settings = typed(ModelSettings, {**tiny_model_cfg(), "loss_chunk_tokens": RANK_CHUNK_TOKENS})
        model = make_model(model_settings, folder=model_dir, layout=Layout(ranks, layout, s))
        before = full_state_dict(model)[0]
        if with_reference:
            attn = model.config._attn_implementation
            reference = base_reference(model, packed_rows(), s, 0, ranks.world_size, attn, "fp32")
            report["reference_experts"] = [len(layer) for layer in reference]
        trainer = Trainer(model, s, packed_rows(), collate_fn=collate, seed=0)
        optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        trained = {id(p) for p in trainer.model.parameters() if p.requires_grad}
        trainer.run()
        runs[with_reference] = [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.train_records()]
        if with_reference:
            report["optimizer_holds_the_parameters"] = optimized == trained
            after = full_state_dict(trainer.model)[0]
            report["untrained"] = sorted(name for name in before if torch.equal(before[name], after[name]))
            trainer.save(out / "checkpoint")
            report["saved"] = (out / "checkpoint" / "trainer_state.json").is_file()
    report["with_reference"], report["without_reference"] = runs[True], runs[False]
    if ranks.is_main:
        (out / "report.json").write_text(json.dumps(report))


def _lora(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> None:
    """Per case of LORA_CASES: LoRA straight through with a checkpoint per step, then resumed from it; the adapter and
    the merged model of the straight run under ``out/<case>``."""
    from moeflow.model.parameters import is_adapter

    report = {}
    for case in (c for strategy, c in LORA_LAYOUT_CASES if strategy == layout.strategy):
        folder, model_dir = out / case, lora_folder(Path(model_dir).parent, case, layout.strategy)
        straight = lora_trainer(model_dir, layout, ranks, case, folder / "ck")
        frozen = {n for n, p in straight.model.named_parameters() if not p.requires_grad}
        before = {n: t for n, t in full_state_dict(straight.model)[0].items() if n in frozen}
        straight.run()
        after = full_state_dict(straight.model)[0]
        resumed = lora_trainer(model_dir, layout, ranks, case, folder / "ck")
        assert resumed.resume()
        continued_from = resumed.step
        resumed.run()
        params = dict(straight.model.named_parameters())
        report[case] = {
            "straight": records(straight),
            "resumed": records(resumed),
            "continued_from": continued_from,
            "frozen_unchanged": sorted(before) == sorted(frozen)
            and all(torch.equal(before[n], after[n]) for n in frozen),
            "trained": sorted(n for n, p in params.items() if p.requires_grad),
            "adapters": sorted(n for n in params if is_adapter(n)),
            "dtypes": {
                "frozen": sorted({str(p.dtype) for n, p in params.items() if n in frozen and p.dim() > 1}),
                "adapters": sorted({str(p.dtype) for n, p in params.items() if is_adapter(n)}),
            },
            "sharded": all(is_dtensor(p) for p in params.values()),
        }
        lora_outputs(straight, folder, model_dir)
    if ranks.is_main:
        (out / "report.json").write_text(json.dumps(report))


def _offload(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> None:
    """The steps part's straight and resumed run, and the bf16 LoRA and QLoRA cases' straight runs, with
    ``cpu_offload``."""
    offloaded = dataclasses.replace(layout, cpu_offload=True)
    straight, resume = straight_and_resumed(model_dir, out, ranks, offloaded)
    lora = {}
    for case in ("bf16", "nf4-bf16"):
        lora[case] = lora_trainer(lora_folder(Path(model_dir).parent, case), offloaded, ranks, case)
        lora[case].run()
    report = resume | {
        "parameters": offloaded_parameters(straight.model),
        "lora": {case: records(trainer) for case, trainer in lora.items()},
    }
    if ranks.is_main:
        (out / "report.json").write_text(json.dumps(report))


def offloaded_parameters(model: torch.nn.Module) -> dict:
    """Where the model's parameters are, whether every FSDP2 unit offloads them, and where it computes."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    params = list(model.parameters())
    return {
        "devices": sorted({str(p.device) for p in params}),
        "dtensors": all(is_dtensor(p) for p in params),
        "offloaded": bool(groups) and all(p.offload_to_cpu for g in groups if g for p in g.fsdp_params),
        "compute": str(model_device(model)),
    }


def _offload_alone(model_dir: str, out: Path, ranks: Ranks, layout: ParallelSettings) -> None:
    """One process (a group of one) with ``cpu_offload``: the one-process run's steps."""
    trainer = make_trainer(model_dir, layout, ranks, settings("running", 1, micro_batch_size=MICRO_BATCH * RANKS))
    trainer.run()
    report = {"losses": [r["loss"] for r in trainer.train_records()], "parameters": offloaded_parameters(trainer.model)}
    (out / "report.json").write_text(json.dumps(report))


PARTS = {
    "steps": _steps,
    "base-reference": _base_reference,
    "lora": _lora,
    "offload": _offload,
    "offload-alone": _offload_alone,
}


def _main(model_dir: str, out: str, parallel_json: str, parts: str) -> None:
    """The parts named in ``parts`` (comma-separated), in one process group, each in its own folder under ``out``."""
    torch.set_num_threads(1)
    layout = parallel(**json.loads(parallel_json))
    ranks = init("cpu", group_of_one=layout.cpu_offload)
    check_ranks(layout, ranks)
    for part in parts.split(","):
        folder = Path(out) / part
        folder.mkdir(parents=True, exist_ok=True)
        PARTS[part](model_dir, folder, ranks, layout)
    teardown()


if __name__ == "__main__":
    _main(*sys.argv[1:5])
