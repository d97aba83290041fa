"""Stage coverage_valset: route the held-out pool through the base model (before fine-tuning) and select
the validation set that exercises every (layer, expert) and the frequent expert pairs (moeflow.coverage.build).
Writes the valset (data-stage format), coverage.json (with the random-subset comparison) and the heatmap;
fails listing the unmet constraints unless coverage.allow_unmet is set."""

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.model.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage
from moeflow.settings import typed

stage = Stage.start(snakemake)
settings = snakemake.params.settings  # moeflow.workflow.keys.coverage_settings
model_settings = typed(ModelSettings, settings["model"])
model = make_model(
    model_settings,
    experts=snakemake.input.experts,
    folder=snakemake.input.model,
    device=compute_device(snakemake.params.device),
    dtype=compute_dtype(stage.precision),
    data=list(snakemake.input.pool),
)
build_valset(
    model,
    list(snakemake.input.pool),
    settings["coverage"],
    StageOutputs(snakemake.output.valset, snakemake.output.json, snakemake.output.heatmap),
    attn_implementation=model_settings.attn_implementation,
    seed=settings["seed"],  # the run's seed (part of the coverage key)
    precision=stage.precision,
    provenance=stage.provenance() | {"base_key": settings["base"], "data_key": settings["data"]},
)
