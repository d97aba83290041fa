"""Evaluate one model of a run (the base or the fine-tuned one) on the coverage validation set and on each eval
corpus's test split: loss, perplexity, per-expert load and loss, the validation set's coverage by its router, and
the throughput and peak memory of the passes. Started through torchrun by its rule: ``evaluate.ranks`` ranks hold
the model in parallel.strategy's layout (moeflow.loading.factory.Layout: fsdp shards it as training does), each
evaluates its share of the batches and the sums are added up (moeflow.evaluation.run_metrics); rank 0 writes the
record, and an MoE model's routing of the validation set token by token (moeflow.evaluation.token_routing). Rules
evaluate_run and routing_drift compare the two models' records and routings."""

from moeflow.data.shards import open_split
from moeflow.data.valset import open_valset
from moeflow.evaluation import run_metrics as ev
from moeflow.evaluation.drift import write_routing
from moeflow.evaluation.token_routing import model_routing
from moeflow.model.routing import NoMoELayers
from moeflow.parallel.process_group import gather_objects, teardown
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.stages.forward import EvaluateModelStage, forward_layout, load_model

job = Job.from_argv(EvaluateModelStage)
stage = Stage.start(job)
settings = job.settings
layout = forward_layout(job, stage, job.input.model)
device = layout.ranks.device

sets = [ev.EvalSet("valset", list(settings.coverage["pool_corpora"]), open_valset(job.input.valset))]
tests = zip(settings.eval_corpora, job.input.eval_data)
sets += [ev.EvalSet(f"test/{c}", [c], open_split(d, "test")) for c, d in tests]

model = load_model(job, stage, layout, job.input.model, data=job.input.eval_data)
stats = ev.evaluate_model(model, sets, settings.evaluate, stage.precision, layout.ranks)
coverage = ev.valset_coverage(model, sets[0].rows, settings.coverage, stage.precision, layout.ranks)
record = ev.model_record(sets, stats, coverage, ev.parameter_counts(model))
try:
    routing = model_routing(model, sets[0].rows, settings.evaluate, stage.precision, "valset", layout.ranks)
except NoMoELayers:
    routing = []  # a dense model: its routing file holds no layer, and no routing_drift job reads it

peak = max(gather_objects(ev.peak_memory_bytes(device.type)))
if layout.ranks.is_main:
    record["speed"] = ev.speed_record(stats.values())
    record["memory"] = {"peak_memory_bytes": peak, "device": device.type, "ranks": layout.ranks.world_size}
    record["provenance"] = stage.provenance()
    write_routing(job.output.routing, routing)
    write_json(job.output.json, record)
teardown()
