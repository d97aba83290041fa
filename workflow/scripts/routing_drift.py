"""Routing drift of one MoE run: its base and its fine-tuned model routed over the coverage validation set,
compared per MoE layer (moeflow.evaluation.drift).
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold each model in evaluate.strategy's layout
(moeflow.loading.factory.Layout: fsdp shards it as training does) and route their share of the batches; rank 0
puts the batches back in order and writes the record."""

import gc

from moeflow.data.valset import open_valset
from moeflow.evaluation import drift
from moeflow.parallel.process_group import teardown
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point
from moeflow.stages.forward import RoutingDriftStage, forward_layout, load_model

job = Job.from_argv(RoutingDriftStage)
stage = Stage.start(job)
layout = forward_layout(job, stage, job.input.base)
rows = open_valset(job.input.valset)

routing = {}
for label in ("base", "finetuned"):
    model = load_model(job, stage, layout, job.input[label])
    routing[label] = drift.model_routing(model, rows, job.settings.evaluate, stage.precision, label, layout.ranks)
    del model
    gc.collect()
    kill_point(f"routing_drift.{label}")

if layout.ranks.is_main:
    record = drift.drift_record(routing["base"], routing["finetuned"])
    write_json(job.output.json, {**record, "provenance": stage.provenance()})
teardown()
