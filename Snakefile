# moeflow: fine-tune mixture-of-experts language models, reproducibly.
#
#   snakemake --cores 8 train     environment, experts choice -> tokenizer -> shards -> base model -> coverage set,
#                                 memory plan -> warmup -> fine-tuned model, for every run
#   snakemake --cores 8 paper     and each run evaluated (losses, lm-eval tasks, HumanEval, routing drift)
#                                 -> the paper's figures and tables (and, with serve.python set, each export
#                                 checked in vLLM: workflow/rules/serve.smk)
#   snakemake --cores 2 verify_env
#
# A finished train or paper ends with the report card of every run, kept in results/{stack}/report_card.md.
#
# Outputs live under results/{stack}/; each stage is one file in workflow/rules/, a thin script in
# workflow/scripts/, over the moeflow package in src/moeflow/. A stage reruns when its params, its input files
# or the library code it declares (moeflow.workflow.rule_code) change, and nothing else: docs/reruns.md.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


wildcard_constraints:
    run="[A-Za-z0-9][A-Za-z0-9_.-]*",
    corpus="[A-Za-z0-9][A-Za-z0-9_.-]*",
    tokkey="t-[0-9a-f]+",
    datakey="d-[0-9a-f]+",
    basekey="b-[0-9a-f]+",
    covkey="c-[0-9a-f]+",
    warmkey="w-[0-9a-f]+",
    routkey="r-[0-9a-f]+",
    selkey="s-[0-9a-f]+",


include: "workflow/rules/env.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/coverage.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/lm_eval.smk"
include: "workflow/rules/humaneval.smk"
include: "workflow/rules/drift.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/paper.smk"


onsuccess:
    # The report card of every run (losses, routing, memory, where things are): common.smk's print_report_card.
    print_report_card()


rule train:
    # The pipeline's main target: every run's fine-tuned model (and the environment report).
    input:
        rules.verify_env.output.json,
        [t for run, cfg in RUNS.items() for t in run_targets(cfg, run)],
        [final_model_dir(run) for run in RUNS],
        [adapter for adapter in map(serving_adapter_dir, RUNS) if adapter],  # workflow/rules/serve.smk
    default_target: True


rule evaluate:
    # Every run evaluated: base vs fine-tuned loss and perplexity per set (forgetting), per expert, coverage rechecked.
    # `snakemake --cores 8 paper` (rule paper in workflow/rules/paper.smk) then makes the figures and tables.
    input:
        [f"{RESULTS}/runs/{run}/eval/metrics.json" for run in RUNS],


rule on_device:
    # Every stage that runs a model, for every run: rule evaluate's, and the lm-eval tasks, HumanEval's generated
    # samples and the routing drift, without HumanEval's sandboxed execution and the paper (CPU work). What the GPU
    # check runs on a lent machine (docs/gpu.md).
    input:
        rules.evaluate.input,
        model_stage_results,
