# moeflow: fine-tune mixture-of-experts language models, reproducibly.
#
#   snakemake --cores 8 train     environment -> tokenizer -> shards -> base model -> coverage set -> plan
#   snakemake --cores 2 verify_env
#
# Outputs live under results/{stack}/; each stage is one file in workflow/rules/, a thin script in
# workflow/scripts/, over the moeflow package in src/moeflow/.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/env.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/coverage.smk"
include: "workflow/rules/plan.smk"


def run_targets(cfg, run):
    """Everything a run needs before fine-tuning starts."""
    return [
        f"{RESULTS}/runs/{run}/plan.json",
        f"{coverage_dir(cfg)}/coverage.json",
    ] + [data_dir(cfg, c) for c in [cfg["data"]["finetune_corpus"], *cfg["data"]["eval_corpora"]]]


rule train:
    # The pipeline's main target. Later stages (warmup, train_model) extend it to the final model.
    input:
        rules.verify_env.output.json,
        [t for run, cfg in RUNS.items() for t in run_targets(cfg, run)],
    default_target: True
