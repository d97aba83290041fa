"""Routing drift of one MoE run: its base and its fine-tuned model's routings of the coverage validation set (rule
evaluate_model's, the base model's shared by the runs that fine-tune it), compared per MoE layer
(moeflow.evaluation.drift). Loads no model."""

from moeflow.evaluation import drift
from moeflow.evaluation.drift import RoutingDriftStage
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

job = Job.from_snakemake(snakemake, RoutingDriftStage)
stage = Stage.start(job)
routing = {label: drift.read_routing(job.input[label]) for label in ("base", "finetuned")}
record = drift.drift_record(routing["base"], routing["finetuned"])
write_json(job.output.json, {"run": job.settings.run, **record, "provenance": stage.provenance()})
