"""Checkpoints in one process: the folder's files (safetensors plus JSON, no pickle), an exact round trip,
atomic saves (a kill between the writes and the rename leaves the previous checkpoint whole), partial folders
ignored and removed, and the refusals (a missing file, the old format, another model's checkpoint). On two gloo
ranks that see different ``step-*`` folders, every rank resumes from rank 0's choice, or every rank fails.
Resharding over ranks and layouts: tests/pipeline/test_resharding.py."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tiny_models, tiny_training

from gloo_ranks import run_ranks  # noqa: E402
from tiny_models import tiny_model_cfg  # noqa: E402
from tiny_training import VOCAB, losses, make_trainer, packed_rows, run_training_script, settings  # noqa: E402

from moeflow.checkpoint import state as checkpoint_state  # noqa: E402
from moeflow.checkpoint.state import CheckpointError, latest_checkpoint, partial_folder, step_folder  # noqa: E402
from moeflow.checkpoint.storage import ShardWriter  # noqa: E402
from moeflow.data.collate import collate  # noqa: E402
from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model.safetensors_files import read_header  # noqa: E402
from moeflow.model.settings import ModelSettings
from moeflow.parallel.layouts import full_state_dict
from moeflow.settings import typed
from moeflow.train.trainer import Trainer  # noqa: E402


def whole_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and every optimizer tensor (both AdamW moments and the step) by name."""
    weights, optim = full_state_dict(trainer.model, trainer.optimizer)
    flat = {f"model/{k}": v for k, v in weights.items()}
    flat.update({f"optimizer/{n}/{k}": v for n, s in optim["state"].items() for k, v in s.items()})
    return flat


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_a_checkpoint_is_safetensors_and_json_only_and_loads_back_exactly(tmp_path):
    trainer = make_trainer()
    trainer.run(until=2)
    trainer.save(tmp_path / "step-00000002", extra_json={"report.json": {"ok": True}})
    folder = tmp_path / "step-00000002"
    assert sorted(p.name for p in folder.iterdir()) == [
        "dcp_metadata.json",
        "report.json",
        "rng.safetensors",
        "shard-0.safetensors",
        "timings.json",
        "trainer_state.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # no partial folder left
    entries, _ = read_header(folder / "shard-0.safetensors")
    assert {n.split("/")[0] for n in entries} == {"model", "optimizer"}
    # every parameter (frozen ones too) and both AdamW moments of every trained parameter
    names = {n for n, _ in trainer.model.named_parameters()}
    assert {n.removeprefix("model/") for n in entries if n.startswith("model/")} >= names
    assert sum(n.endswith("/exp_avg_sq") for n in entries) == sum(p.requires_grad for p in trainer.model.parameters())

    # other initial weights: everything must come from the checkpoint
    resumed = Trainer(
        make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=1),
        settings(),
        packed_rows(),
        collate_fn=collate,
        seed=0,
    )
    resumed.load(folder)
    assert resumed.step == 2
    assert_same_state(whole_state(resumed), whole_state(trainer))
    trainer.run()
    resumed.run()
    assert losses(resumed) == losses(trainer)


def test_dcp_values_that_are_not_tensors_are_refused_never_pickled(tmp_path):
    with pytest.raises(
        CheckpointException, match="NotATensor: checkpoint values that are not tensors would be pickled: step"
    ):
        dcp.save({"step": 3, "w": torch.zeros(2)}, storage_writer=ShardWriter(tmp_path / "c", rank=0))
    assert not (tmp_path / "c" / "dcp_metadata.json").exists()


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """Killed between the shard writes and the rename of step 4's checkpoint: step 2's is the newest, the
    partial folder is ignored, and the resumed run gives the uninterrupted run's losses (then removes it)."""
    checkpoints = tmp_path / "checkpoints"
    first = run_training_script(__file__, tmp_path, 3)  # saves step 2
    assert first.returncode == 0, first.stderr
    killed = run_training_script(__file__, tmp_path, 6, kill_at="checkpoint.save")  # resumes at 2, killed saving step 4
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    partial = partial_folder(step_folder(checkpoints, 4))
    assert (partial / "shard-0.safetensors").is_file() and (partial / "dcp_metadata.json").is_file()
    assert sorted(p.name for p in checkpoints.iterdir()) == [partial.name, "step-00000002"]
    assert latest_checkpoint(checkpoints) == step_folder(checkpoints, 2)

    resumed = run_training_script(__file__, tmp_path, 6)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004"]  # the partial one removed
    straight = make_trainer()
    straight.run()
    assert json.loads((tmp_path / "losses.json").read_text()) == [list(r) for r in losses(straight)]


def test_a_checkpoint_missing_a_shard_file_is_refused(tmp_path):
    trainer = make_trainer()
    trainer.run(until=1)
    trainer.save(tmp_path / "c")
    (tmp_path / "c" / "shard-0.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        make_trainer().load(tmp_path / "c")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'c'} lacks shard-0.safetensors: moeflow reads checkpoints as safetensors plus "
        "JSON only (pickle files are never loaded: unpickling can run code). Delete the folder to start the "
        "stage afresh"
    )


def test_an_old_format_checkpoint_is_refused_naming_what_to_do(tmp_path):
    old = tmp_path / "step-00000002"
    old.mkdir()
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"):
        (old / name).write_bytes(b"{}")
    with pytest.raises(CheckpointError) as err:
        make_trainer().load(old)
    assert str(err.value) == (
        f"checkpoint {old} is in moeflow's old format (whole model.safetensors and optimizer.safetensors), "
        "which this version no longer reads: delete the folder and rerun the stage that wrote it"
    )


def test_another_models_checkpoint_is_refused_naming_the_tensors(tmp_path):
    trainer = make_trainer()
    trainer.run(until=1)
    trainer.save(tmp_path / "c")
    wider = make_model(typed(ModelSettings, tiny_model_cfg(moe_intermediate_size=8)), vocab_size=VOCAB, seed=0)
    other = Trainer(wider, settings(), packed_rows(), collate_fn=collate, seed=0)
    with pytest.raises(
        CheckpointError, match=r"does not match this run's model and optimizer: .*experts.* is \["
    ) as err:
        other.load(tmp_path / "c")
    assert str(err.value).startswith(f"checkpoint {tmp_path / 'c'} ")
    assert str(err.value).endswith(
        "It was saved by another model or settings: delete the folder to start the stage afresh"
    )
    deeper = make_model(typed(ModelSettings, tiny_model_cfg(num_hidden_layers=3)), vocab_size=VOCAB, seed=0)
    other = Trainer(deeper, settings(), packed_rows(), collate_fn=collate, seed=0)
    with pytest.raises(CheckpointError, match=r"it lacks model/model\.layers\.2\."):
        other.load(tmp_path / "c")


def _main(folder: str, until: str) -> None:
    """Train in this process until ``until`` with a checkpoint every 2 steps (the kill test)."""
    torch.set_num_threads(1)
    folder = Path(folder)
    trainer = make_trainer(checkpoint_dir=folder / "checkpoints", train_settings=settings(checkpoint_every=2))
    trainer.resume()
    trainer.run(until=int(until))
    (folder / "losses.json").write_text(json.dumps(losses(trainer)))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO)
    _main(*sys.argv[1:3])


def _with_an_unused_parameter(model: torch.nn.Module) -> torch.nn.Module:
    """A trainable parameter no forward pass uses: like an expert no token reached (transformers 4.57 runs
    only the experts that got tokens), it never gets a gradient from the backward pass."""
    model.register_parameter("never_routed", torch.nn.Parameter(torch.ones(3, 3)))  # a matrix: weight decay
    return model


def test_a_parameter_no_token_reached_steps_with_a_zero_gradient_and_resumes_as_the_uninterrupted_run(tmp_path):
    """As under FSDP and with transformers 5's fused experts, where such an expert holds zero gradients: AdamW
    steps it (zero moments, weight decay only), so one process trains as several ranks do; and it resumes exactly."""

    def trainer(seed: int) -> Trainer:
        model = _with_an_unused_parameter(
            make_model(typed(ModelSettings, tiny_model_cfg()), vocab_size=VOCAB, seed=seed)
        )
        return Trainer(model, settings(), packed_rows(), collate_fn=collate, seed=0)

    straight = trainer(0)
    straight.run(until=2)
    state = straight.optimizer.state[straight.model.never_routed]
    assert int(state["step"]) == 2 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert (straight.model.never_routed.detach() < 1).all()  # decayed, as every weight of a decayed group
    straight.save(tmp_path / "step-00000002")
    resumed = trainer(1)
    resumed.load(tmp_path / "step-00000002")
    assert_same_state(whole_state(resumed), whole_state(straight))
    straight.run()
    resumed.run()
    assert losses(resumed) == losses(straight)


def _fake_checkpoint(folder: Path, step: int, complete: bool = True) -> None:
    path = step_folder(folder, step)
    path.mkdir(parents=True)
    if complete:
        (path / checkpoint_state.STATE_FILE).write_text("{}")


def _resume_rank(rank: int, root: str, results: dict) -> None:
    """This rank's view of the checkpoint folder: rank 0 sees steps 2 and 4, rank 1 steps 2 and 6 (and a
    partial 8); then rank 1 sees none of rank 0's checkpoints complete."""
    import torch.distributed as dist

    from moeflow.parallel.process_group import destroy

    root = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=2)
    try:
        view = root / f"view{rank}"
        results[f"{rank}.own"] = latest_checkpoint(view)
        results[f"{rank}.agreed"] = checkpoint_state.resume_point(view)
        if rank == 1:
            checkpoint_state.is_complete = lambda path: False  # the other rank's view is stale
        try:
            checkpoint_state.resume_point(view)
        except CheckpointError as error:
            results[f"{rank}.blind"] = str(error)
        results[f"{rank}.nothing"] = checkpoint_state.resume_point(root / "empty" if rank == 0 else view)
    finally:
        destroy()


def test_every_rank_resumes_from_rank_0s_checkpoint_or_every_rank_fails(tmp_path):
    for step in (2, 4):
        _fake_checkpoint(tmp_path / "view0", step)
    for step in (2, 6):
        _fake_checkpoint(tmp_path / "view1", step)
    _fake_checkpoint(tmp_path / "view1", 8, complete=False)
    results = run_ranks(_resume_rank, str(tmp_path))
    chosen = step_folder(tmp_path / "view0", 4)
    assert (results["0.own"], results["1.own"]) == (chosen, step_folder(tmp_path / "view1", 6))  # alone: they differ
    assert results["0.agreed"] == results["1.agreed"] == chosen
    for rank in (0, 1):  # no rank goes on into a collective load the other never joins
        assert "rank(s) [1] do not see complete" in results[f"{rank}.blind"] and str(chosen) in results[f"{rank}.blind"]
    assert results["0.nothing"] is None and results["1.nothing"] is None  # rank 0 sees none: nobody resumes
