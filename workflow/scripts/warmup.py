"""Stage warmup: the linear learning-rate warmup of fine-tuning, saved as a full checkpoint (weights,
optimizer, RNG states, data position, metrics so far) plus a routing-stability report. A router that
ends the warmup unstable (collapsed layer, dead experts, load beyond train.routing_guard) fails the
stage with the report, before the expensive part starts."""

from pathlib import Path

from moeflow.guards import UnstableRouting
from moeflow.io import atomic_dir, dumps_json, write_json
from moeflow.modeling import load_model
from moeflow.stage import Stage, log
from moeflow.tokenize import open_split
from moeflow.train import TrainSettings, init_distributed, job_from_argv, prepare_model, train_stage

snakemake = job_from_argv()
stage = Stage.from_snakemake(snakemake)
device = init_distributed()
settings = snakemake.params.settings  # mfconfig.warmup_settings
warmup_steps = settings["train"]["warmup_steps"]

model = prepare_model(load_model(snakemake.input.model, settings["model"]).to(device), settings["train"])
rows = open_split(snakemake.input.data, "train")
trainer = train_stage(
    stage, model, TrainSettings.from_config({**settings["train"], "steps": warmup_steps}), rows,
    attn_implementation=settings["model"]["attn_implementation"],
    log_dir=None,
    checkpoint_root=snakemake.params.checkpoints,
    key_settings=settings,
    key_inputs=[snakemake.input.model, snakemake.input.data],
)
report = {**trainer.routing_guard.report(), "step": trainer.step, "provenance": stage.provenance()}
if trainer.rank == 0:
    if not report["stable"]:
        write_json(snakemake.params.failed_report, report)
        log.error("routing is unstable after warmup:\n%s", dumps_json(report))
        trainer.remove_checkpoints()
        raise UnstableRouting(
            f"warmup: routing is unstable after {trainer.step} steps: {'; '.join(report['problems'])}. "
            f"Report: {snakemake.params.failed_report}. Lengthen train.warmup_steps, lower train.lr, raise "
            "train.balance.coef, or relax train.routing_guard", report)
    with atomic_dir(snakemake.output.checkpoint) as out:
        trainer.write_checkpoint(out)
        write_json(Path(out) / "routing_report.json", report)
trainer.remove_checkpoints()
