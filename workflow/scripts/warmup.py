"""Stage warmup: the linear learning-rate warmup of fine-tuning, saved as a full checkpoint (weights, optimizer, RNG
states, data position, metrics so far) plus a routing-stability report. A router that ends the warmup unstable
(collapsed layer, dead experts, load beyond train.routing_guard) fails the stage with the report, before the
expensive part starts. With train.routing_guard.reference base (the default) the gate judges change against the base
model's own routing on the rows of the gate's window, routed here before training
(moeflow.train.guards.base_reference); the reference travels in the checkpoint to train_model, and so do the peaks of
memory measured in its phases (phase_peaks.json, for the report card). Started through torchrun by its rule: every
rank runs this script; the layout is the config's ``parallel`` section (moeflow.loading.factory.Layout)."""

from moeflow.data.shards import open_split
from moeflow.loading.factory import Layout, make_model
from moeflow.parallel.process_group import gather_objects, teardown
from moeflow.runtime.files import dumps_json, read_json, write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, log
from moeflow.train.guards import UnstableRouting, base_reference
from moeflow.train.peak_memory import PHASE_PEAKS_FILE, PhasePeaks, by_phase
from moeflow.train.settings import WarmupStage
from moeflow.train.trainer import train_stage

job = Job.from_argv(WarmupStage)
stage = Stage.start(job)
settings = job.settings  # train: the warmup part's (train.warmup_steps steps)
layout = Layout.join(settings.parallel, settings.hardware_device, settings.train, stage.precision)
# the data first: its libraries are part of the rank's runtime in every phase, as the memory plan counts it
rows = open_split(job.input.data, "train")
peaks = PhasePeaks(layout.ranks.device)
with peaks.measure("load"):  # the base's weights read: the memory plan's load phase (train_model reads none)
    model = make_model(  # seed: LoRA's adapters start from it
        settings.model,
        experts=job.input.experts,
        folder=job.input.model,
        layout=layout,
        seed=stage.seed,
        data=[job.input.data],
    )
# train.method esft: rule esft_select's experts (the only ones that train); its file keys the checkpoints too
selection = read_json(job.input.selection) if settings.train.method == "esft" else None
selection_inputs = [job.input.selection] if selection else []
reference = None
if settings.train.routing_guard.reference == "base":  # before train_stage: a resumed run has the base model here too
    reference = base_reference(
        model,
        rows,
        settings.train,
        stage.seed,
        layout.ranks.world_size,
        settings.model.attn_implementation,
        stage.precision,
    )
trainer = train_stage(
    stage,
    model,
    settings.train,
    rows,
    log_dir=None,
    checkpoint_root=job.params.checkpoints,
    key_settings=job.params.settings,
    key_inputs=[job.input.model, job.input.data, *selection_inputs],
    expert_selection=selection,
    peaks=peaks,
)
trainer.routing_guard.set_reference(reference)
# The routing report is the all-reduced counts': the same verdict on every rank.
report = {**trainer.routing_guard.report(), "step": trainer.step, "provenance": stage.provenance()}
if not report["stable"]:
    trainer.remove_checkpoints()
    if layout.ranks.is_main:
        write_json(job.params.failed_report, report)
        log.error("routing is unstable after warmup:\n%s", dumps_json(report))
    raise UnstableRouting(
        f"warmup: routing is unstable after {trainer.step} steps: {'; '.join(report['problems'])}. "
        f"Report: {job.params.failed_report}. Lengthen train.warmup_steps, lower train.lr, raise "
        "train.balance.coef, or relax train.routing_guard",
        report,
    )
# each phase's peak so far on every rank, for train_model's record of the run (a collective)
measured = {"device": layout.ranks.device.type, "bytes": by_phase(gather_objects(peaks.bytes))}
trainer.save(job.output.checkpoint, extra_json={"routing_report.json": report, PHASE_PEAKS_FILE: measured})
trainer.remove_checkpoints()
teardown()
