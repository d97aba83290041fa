# Evaluation of each run: the base and the fine-tuned model on the coverage validation set and on each
# eval corpus's test split (loss, perplexity, forgetting), per expert (load, loss of the tokens served,
# balance), and the validation set's coverage rechecked with the fine-tuned router. One job per model
# (evaluate_model): runs that fine-tune one base model and evaluate it alike read one job's record of it.


rule evaluate_model:
    # Started through torchrun like the training rules: evaluate.ranks ranks share the model in parallel.strategy's
    # layout (fsdp: sharded, loaded as training loads it) and the batches; one rank by default. The layout changes
    # no number (tests/pipeline/test_sharded_evaluation.py), but starts the stage anew.
    input:
        model=evaluated_model_dir,
        experts=experts,
        valset=valset,
        eval_data=eval_data,
        script="workflow/scripts/evaluate_model.py",
        lib=code("evaluate_model"),
    output:
        # the record, and the routing rule routing_drift compares (EVALUATE_MODEL_ENDINGS)
        json=f"{RESULTS}/runs/{{run}}/eval/sets/{{model}}{EVALUATE_MODEL_ENDINGS['json']}",
        routing=f"{RESULTS}/runs/{{run}}/eval/sets/{{model}}{EVALUATE_MODEL_ENDINGS['routing']}",
    wildcard_constraints:
        model="base|finetuned",
    params:
        **torchrun_params("evaluate_model"),
    resources:
        gpu=job_gpus("evaluate_model"),
    threads: config["threads"]
    log:
        log_path("evaluate_model", "{run}", "{model}"),
    benchmark:
        bench_path("evaluate_model", "{run}", "{model}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL


rule evaluate_run:
    # Reads the two records only: no model, no GPU.
    input:
        base=evaluated("base", "json"),
        finetuned=evaluated("finetuned", "json"),
        lib=code("evaluate_run"),
    output:
        metrics=f"{RESULTS}/runs/{{run}}/eval/metrics.json",
        speed=f"{RESULTS}/runs/{{run}}/eval/speed.json",
        summary=report(f"{RESULTS}/runs/{{run}}/eval/summary.md", caption="../report/evaluate.rst", category="Evaluation", subcategory="{run}"),
    params:
        settings=settings("evaluate_run"),
        runtime=job_runtime("evaluate_run"),
    threads: 1
    log:
        log_path("evaluate_run", "{run}"),
    benchmark:
        bench_path("evaluate_run", "{run}")
    conda:
        ENV_FILE
    script:
        "../scripts/evaluate.py"
