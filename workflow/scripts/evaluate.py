"""Evaluate one run: the base and the fine-tuned model on the coverage validation set and on each eval
corpus's test split (loss, perplexity, per-expert load and loss), the coverage of the validation set
rechecked with the fine-tuned router, and the throughput and peak memory of the evaluation passes.
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold the model in parallel.strategy's layout
(moeflow.model.factory.Layout: fsdp shards it as training does), each evaluates its share of the batches and
the sums are added up (moeflow.evaluation.run_metrics); rank 0 writes the outputs."""

import gc

from moeflow.data.shards import open_split
from moeflow.data.valset import open_valset
from moeflow.evaluation import run_metrics as ev
from moeflow.model.device import compute_dtype
from moeflow.model.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel.process_group import gather_objects, teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.forward import refuse_unless_fits
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point
from moeflow.settings import typed

job = Job.from_argv()
stage = Stage.start(job)
params = job.params
layout = Layout.join(typed(ParallelSettings, params.parallel), params.device, None, stage.precision)
refuse_unless_fits(params.batch, params.model, job.input.base, layout)  # its memory plan, before the load
device = layout.ranks.device

sets = [ev.EvalSet("valset", list(params.pool_corpora), open_valset(job.input.valset))]
sets += [ev.EvalSet(f"test/{c}", [c], open_split(d, "test")) for c, d in zip(params.eval_corpora, job.input.eval_data)]

model_settings = typed(ModelSettings, params.model)
stats, speed, coverage, parameters = {}, {}, {}, {}
for label in ("base", "finetuned"):
    model = make_model(
        model_settings,
        experts=job.input.experts,
        folder=job.input[label],
        layout=layout,
        dtype=compute_dtype(stage.precision),
        data=list(job.input.eval_data),
    )
    stats[label] = ev.evaluate_model(model, sets, params.settings, stage.precision, layout.ranks)
    coverage[label] = ev.valset_coverage(model, sets[0].rows, params.coverage, stage.precision, layout.ranks)
    parameters = ev.parameter_counts(model)
    speed[label] = ev.speed_record(stats[label].values())
    del model
    gc.collect()
    kill_point(f"evaluate.{label}")

peak = max(gather_objects(ev.peak_memory_bytes(device.type)))
if layout.ranks.is_main:
    metrics = ev.run_metrics(params.run, sets, stats["base"], stats["finetuned"], params.finetune_corpus, parameters)
    metrics["coverage_recheck"] = ev.coverage_recheck(coverage["base"], coverage["finetuned"], params.coverage)
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
