"""Routing drift of one MoE run: its base and its fine-tuned model routed over the coverage validation set,
compared per MoE layer (moeflow.evaluation.drift)."""

import gc

from moeflow.data.valset import open_valset
from moeflow.evaluation import drift
from moeflow.model.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime.files import write_json
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage, kill_point
from moeflow.settings import typed

stage = Stage.start(snakemake)
params = snakemake.params
device = compute_device(params.device)
rows = open_valset(snakemake.input.valset)
model_settings = typed(ModelSettings, params.model)

routing = {}
for label in ("base", "finetuned"):
    model = make_model(
        model_settings,
        experts=snakemake.input.experts,
        folder=snakemake.input[label],
        device=device,
        dtype=compute_dtype(stage.precision),
    )
    routing[label] = drift.model_routing(model, rows, params.settings, stage.precision, label)
    del model
    gc.collect()
    kill_point(f"routing_drift.{label}")

record = drift.drift_record(routing["base"], routing["finetuned"])
write_json(snakemake.output.json, {**record, "provenance": stage.provenance()})
