"""Routing drift of one MoE run: its base and its fine-tuned model routed over the coverage validation set,
compared per MoE layer (moeflow.evaluation.drift).
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold each model in evaluate.strategy's layout
(moeflow.model.factory.Layout: fsdp shards it as training does) and route their share of the batches; rank 0
puts the batches back in order and writes the record."""

import gc

from moeflow.data.valset import open_valset
from moeflow.evaluation import drift
from moeflow.model.device import compute_dtype
from moeflow.model.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel.process_group import teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.forward import refuse_unless_fits
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point
from moeflow.settings import typed

job = Job.from_argv()
stage = Stage.start(job)
params = job.params
layout = Layout.join(typed(ParallelSettings, params.parallel), params.device, None, stage.precision)
refuse_unless_fits(params.batch, params.model, job.input.base, layout)  # its memory plan, before the load
rows = open_valset(job.input.valset)
model_settings = typed(ModelSettings, params.model)

routing = {}
for label in ("base", "finetuned"):
    model = make_model(
        model_settings,
        experts=job.input.experts,
        folder=job.input[label],
        layout=layout,
        dtype=compute_dtype(stage.precision),
    )
    routing[label] = drift.model_routing(model, rows, params.settings, stage.precision, label, layout.ranks)
    del model
    gc.collect()
    kill_point(f"routing_drift.{label}")

if layout.ranks.is_main:
    record = drift.drift_record(routing["base"], routing["finetuned"])
    write_json(job.output.json, {**record, "provenance": stage.provenance()})
teardown()
