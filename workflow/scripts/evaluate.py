"""Evaluate one run: the base and the fine-tuned model on the coverage validation set and on each eval
corpus's test split (loss, perplexity, per-expert load and loss), the coverage of the validation set
rechecked with the fine-tuned router, and the throughput and peak memory of the evaluation passes.
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold the model in parallel.strategy's layout
(moeflow.loading.factory.Layout: fsdp shards it as training does), each evaluates its share of the batches and
the sums are added up (moeflow.evaluation.run_metrics); rank 0 writes the outputs."""

import gc

from moeflow.data.shards import open_split
from moeflow.data.valset import open_valset
from moeflow.evaluation import run_metrics as ev
from moeflow.parallel.process_group import gather_objects, teardown
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point
from moeflow.stages.forward import EvaluateRunStage, forward_layout, load_model

job = Job.from_argv(EvaluateRunStage)
stage = Stage.start(job)
settings = job.settings
layout = forward_layout(job, stage, job.input.base)
device = layout.ranks.device

sets = [ev.EvalSet("valset", list(settings.coverage["pool_corpora"]), open_valset(job.input.valset))]
tests = zip(settings.eval_corpora, job.input.eval_data)
sets += [ev.EvalSet(f"test/{c}", [c], open_split(d, "test")) for c, d in tests]

stats, speed, coverage, parameters = {}, {}, {}, {}
for label in ("base", "finetuned"):
    model = load_model(job, stage, layout, job.input[label], data=job.input.eval_data)
    stats[label] = ev.evaluate_model(model, sets, settings.evaluate, stage.precision, layout.ranks)
    coverage[label] = ev.valset_coverage(model, sets[0].rows, settings.coverage, stage.precision, layout.ranks)
    parameters = ev.parameter_counts(model)
    speed[label] = ev.speed_record(stats[label].values())
    del model
    gc.collect()
    kill_point(f"evaluate.{label}")

peak = max(gather_objects(ev.peak_memory_bytes(device.type)))
if layout.ranks.is_main:
    base, finetuned = stats["base"], stats["finetuned"]
    metrics = ev.run_metrics(settings.run, sets, base, finetuned, settings.finetune_corpus, parameters)
    metrics["coverage_recheck"] = ev.coverage_recheck(coverage["base"], coverage["finetuned"], settings.coverage)
    metrics["provenance"] = stage.provenance()
    speed["peak_memory_bytes"] = peak
    speed["device"] = device.type
    speed["ranks"] = layout.ranks.world_size
    speed["provenance"] = stage.provenance()

    write_json(job.output.speed, speed)
    kill_point("evaluate.write")  # some outputs written, not all
    write_text(job.output.summary, ev.summary_markdown(metrics))
    write_json(job.output.metrics, metrics)
teardown()
