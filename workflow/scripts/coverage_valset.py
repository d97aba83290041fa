"""Stage coverage_valset: route the held-out pool through the base model (before fine-tuning) and select
the validation set that exercises every (layer, expert) and the frequent expert pairs (moeflow.coverage).
Writes the valset (data-stage format), coverage.json (with the random-subset comparison) and the heatmap;
fails listing the unmet constraints unless coverage.allow_unmet is set."""

import torch

from moeflow.coverage import StageOutputs, build_valset
from moeflow.modeling import check_vocabulary, load_model
from moeflow.stage import Stage

stage = Stage.from_snakemake(snakemake)
settings = snakemake.params.settings  # mfconfig.coverage_settings + the coverage section as "config"
model_cfg = settings["model"]
device = torch.device("cuda" if snakemake.params.device == "cuda" and torch.cuda.is_available() else "cpu")

model = load_model(snakemake.input.model, model_cfg).to(device)
check_vocabulary(model, list(snakemake.input.pool), snakemake.input.model)
build_valset(
    model,
    list(snakemake.input.pool),
    settings["config"],
    StageOutputs(snakemake.output.valset, snakemake.output.json, snakemake.output.heatmap),
    attn_implementation=model_cfg.get("attn_implementation", "sdpa"),
    seed=settings["seed"],  # the run's seed (part of the coverage key)
    precision=stage.precision,
    provenance=stage.provenance() | {"base_key": settings["base"], "data_key": settings["data"]},
)
