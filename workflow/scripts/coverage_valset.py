"""Stage coverage_valset: route the held-out pool through the base model (before fine-tuning) and select
the validation set that exercises every (layer, expert) and the frequent expert pairs (moeflow.coverage.build).
Writes the valset (data-stage format), coverage.json (with the random-subset comparison) and the heatmap;
fails listing the unmet constraints unless coverage.allow_unmet is set.
Started through torchrun by its rule: ``coverage.ranks`` ranks hold the base model in coverage.strategy's layout
(moeflow.loading.factory.Layout: fsdp shards it as training does) and route their share of the pool's batches;
rank 0 merges the statistics (moeflow.evaluation.routing_stats.merge_parts), selects and writes the outputs."""

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.parallel.process_group import teardown
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.stages.forward import CoverageValsetStage, forward_layout, load_model

job = Job.from_argv(CoverageValsetStage)
stage = Stage.start(job)
settings = job.settings
layout = forward_layout(job, stage, job.input.model)
model = load_model(job, stage, layout, job.input.model, data=job.input.pool)
build_valset(
    model,
    list(job.input.pool),
    settings.coverage,
    StageOutputs(job.output.valset, job.output.json, job.output.heatmap),
    attn_implementation=settings.model.attn_implementation,
    seed=settings.seed,  # the run's seed (part of the coverage key)
    precision=stage.precision,
    provenance=stage.provenance() | {"base_key": settings.base, "data_key": settings.data},
    ranks=layout.ranks,
)
teardown()
