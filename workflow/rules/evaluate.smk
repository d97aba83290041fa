# Evaluation of each run: the base and the fine-tuned model on the coverage validation set and on each
# eval corpus's test split (loss, perplexity, forgetting), per expert (load, loss of the tokens served,
# balance), and the validation set's coverage rechecked with the fine-tuned router.


rule evaluate_run:
    # Started through torchrun like the training rules: evaluate.ranks ranks share the model in parallel.strategy's
    # layout (fsdp: sharded, loaded as training loads it) and the batches; one rank by default. The layout changes
    # no number (tests/pipeline/test_sharded_evaluation.py), but starts the stage anew.
    input:
        base=base_model,
        finetuned=finetuned_model,
        experts=experts,
        valset=valset,
        eval_data=eval_data,
        script="workflow/scripts/evaluate.py",
        lib=code("evaluate_run"),
    output:
        metrics=f"{RESULTS}/runs/{{run}}/eval/metrics.json",
        speed=f"{RESULTS}/runs/{{run}}/eval/speed.json",
        summary=report(f"{RESULTS}/runs/{{run}}/eval/summary.md", caption="../report/evaluate.rst", category="Evaluation", subcategory="{run}"),
    params:
        **torchrun_params("evaluate_run"),
    resources:
        gpu=job_gpus("evaluate_run"),
    threads: config["threads"]
    log:
        log_path("evaluate_run", "{run}"),
    benchmark:
        bench_path("evaluate_run", "{run}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
