"""Routing drift of one MoE run: its base and its fine-tuned model routed over the coverage validation set,
compared per MoE layer (moeflow.evaluation.drift)."""

import gc

from moeflow.data.valset import open_valset
from moeflow.evaluation import drift
from moeflow.model.factory import load_model, resolve_experts
from moeflow.runtime.files import write_json
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage, kill_point

stage = Stage.from_snakemake(snakemake)
params = snakemake.params
device = compute_device(params.device)
rows = open_valset(snakemake.input.valset)
model_cfg = resolve_experts(params.model, snakemake.input.experts)

routing = {}
for label in ("base", "finetuned"):
    model = load_model(snakemake.input[label], model_cfg, compute_dtype(stage.precision)).to(device)
    routing[label] = drift.model_routing(model, rows, params.settings, stage.precision, label)
    del model
    gc.collect()
    kill_point(f"routing_drift.{label}")

record = drift.drift_record(routing["base"], routing["finetuned"])
write_json(snakemake.output.json, {**record, "provenance": stage.provenance()})
