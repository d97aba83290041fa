# Evaluation of each run: the base and the fine-tuned model on the coverage validation set and on each
# eval corpus's test split (loss, perplexity, forgetting), per expert (load, loss of the tokens served,
# balance), and the validation set's coverage rechecked with the fine-tuned router.


EVALUATE_RUN_PARAMS = dict(
    settings=lambda wc: stage_keys.eval_batch_settings(RUNS[wc.run]),  # not lm-eval's or HumanEval's keys
    model=lambda wc: RUNS[wc.run]["model"],
    coverage=lambda wc: coverage_source(RUNS[wc.run])["coverage"],
    pool_corpora=lambda wc: coverage_source(RUNS[wc.run])["coverage"]["pool_corpora"],
    eval_corpora=lambda wc: RUNS[wc.run]["data"]["eval_corpora"],
    finetune_corpus=lambda wc: RUNS[wc.run]["data"]["finetune_corpus"],
    device=lambda wc: RUNS[wc.run]["hardware"]["device"],
    run=lambda wc: wc.run,
    # the layout changes no number (tests/pipeline/test_sharded_evaluation.py), but starts the stage anew
    parallel=lambda wc: stage_keys.forward_parallel(RUNS[wc.run], "evaluate"),
    runtime=lambda wc: runtime(wc.run),
    batch=lambda wc: stage_keys.forward_batch(RUNS[wc.run], "evaluate_run"),  # its memory plan
)


rule evaluate_run:
    # Started through torchrun like the training rules: evaluate.ranks ranks share the model in parallel.strategy's
    # layout (fsdp: sharded, loaded as training loads it) and the batches; one rank by default.
    input:
        base=lambda wc: base_model_dir(RUNS[wc.run]),
        finetuned=lambda wc: final_model_dir(wc.run),
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        valset=lambda wc: f"{coverage_dir(RUNS[wc.run])}/valset",
        eval_data=lambda wc: [data_dir(RUNS[wc.run], c) for c in RUNS[wc.run]["data"]["eval_corpora"]],
        script="workflow/scripts/evaluate.py",
        lib=code("evaluate_run"),
    output:
        metrics=f"{RESULTS}/runs/{{run}}/eval/metrics.json",
        speed=f"{RESULTS}/runs/{{run}}/eval/speed.json",
        summary=report(f"{RESULTS}/runs/{{run}}/eval/summary.md", caption="../report/evaluate.rst", category="Evaluation", subcategory="{run}"),
    params:
        **torchrun_params("evaluate_run", **EVALUATE_RUN_PARAMS),
        launcher=torchrun_launcher("evaluate_run", lambda wc: RUNS[wc.run], lambda cfg: cfg["evaluate"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[wc.run], RUNS[wc.run]["evaluate"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("evaluate_run", "{run}"),
    benchmark:
        bench_path("evaluate_run", "{run}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
