"""Stage coverage_valset: route the held-out pool through the base model (before fine-tuning) and select
the validation set that exercises every (layer, expert) and the frequent expert pairs (moeflow.valset).
Writes the valset (data-stage format), coverage.json (with the random-subset comparison) and the heatmap;
fails listing the unmet constraints unless coverage.allow_unmet is set."""

from moeflow.coverage.build import StageOutputs, build_valset
from moeflow.model.factory import load_model, resolve_experts
from moeflow.model.folder import check_vocabulary
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage

stage = Stage.from_snakemake(snakemake)
settings = snakemake.params.settings  # mfconfig.coverage_settings
model_cfg = resolve_experts(settings["model"], snakemake.input.experts)
device = compute_device(snakemake.params.device)

model = load_model(snakemake.input.model, model_cfg, compute_dtype(stage.precision)).to(device)
check_vocabulary(model, list(snakemake.input.pool), snakemake.input.model)
build_valset(
    model,
    list(snakemake.input.pool),
    settings["coverage"],
    StageOutputs(snakemake.output.valset, snakemake.output.json, snakemake.output.heatmap),
    attn_implementation=model_cfg["attn_implementation"],
    seed=settings["seed"],  # the run's seed (part of the coverage key)
    precision=stage.precision,
    provenance=stage.provenance() | {"base_key": settings["base"], "data_key": settings["data"]},
)
