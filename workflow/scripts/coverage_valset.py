"""Stage coverage_valset: route the held-out pool through the base model (before fine-tuning) and select
the validation set that exercises every (layer, expert) and the frequent expert pairs (moeflow.coverage.build).
Writes the valset (data-stage format), coverage.json (with the random-subset comparison) and the heatmap;
fails listing the unmet constraints unless coverage.allow_unmet is set.
Started through torchrun by its rule: ``coverage.ranks`` ranks hold the base model in coverage.strategy's layout
(moeflow.model.factory.Layout: fsdp shards it as training does) and route their share of the pool's batches;
rank 0 merges the statistics (moeflow.model.routing_stats.merge_parts), selects and writes the outputs."""

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.model.device import compute_dtype
from moeflow.model.factory import Layout, make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel.process_group import teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.forward import refuse_unless_fits
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.settings import typed

job = Job.from_argv()
stage = Stage.start(job)
params = job.params
settings = params.settings  # moeflow.workflow.keys.coverage_settings
layout = Layout.join(typed(ParallelSettings, params.parallel), params.device, None, stage.precision)
refuse_unless_fits(params.batch, settings["model"], job.input.model, layout)  # its memory plan, before the load
model_settings = typed(ModelSettings, settings["model"])
model = make_model(
    model_settings,
    experts=job.input.experts,
    folder=job.input.model,
    layout=layout,
    dtype=compute_dtype(stage.precision),
    data=list(job.input.pool),
)
build_valset(
    model,
    list(job.input.pool),
    settings["coverage"],
    StageOutputs(job.output.valset, job.output.json, job.output.heatmap),
    attn_implementation=model_settings.attn_implementation,
    seed=settings["seed"],  # the run's seed (part of the coverage key)
    precision=stage.precision,
    provenance=stage.provenance() | {"base_key": settings["base"], "data_key": settings["data"]},
    ranks=layout.ranks,
)
teardown()
