# HumanEval pass@k of each run's base and fine-tuned model. Generation and execution are two rules, cached
# apart: changing a sandbox setting (timeout_s, memory_mb) or k reruns the execution only, and generated code
# runs only inside moeflow.evaluation.sandbox, never in a rule's own process.


rule humaneval_generate:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout.
    input:
        model=evaluated_model_dir,
        experts=experts,
        script="workflow/scripts/humaneval_generate.py",
        lib=code("humaneval_generate"),
    output:
        samples=f"{RESULTS}/runs/{{run}}/eval/humaneval/{{model}}/samples.jsonl",
    wildcard_constraints:
        model="base|finetuned",
    params:
        **torchrun_params("humaneval_generate"),
    resources:
        gpu=job_gpus("humaneval_generate"),
    threads: config["threads"]
    log:
        log_path("humaneval_generate", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_generate", "{run}", "{model}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL


rule humaneval_execute:
    input:
        samples=rules.humaneval_generate.output.samples,
        lib=code("humaneval_execute"),
    output:
        results=f"{RESULTS}/runs/{{run}}/eval/humaneval/{{model}}/results.json",
        summary=report(f"{RESULTS}/runs/{{run}}/eval/humaneval/{{model}}/summary.md", caption="../report/humaneval.rst", category="Evaluation", subcategory="{run}"),
    wildcard_constraints:
        model="base|finetuned",
    params:
        settings=settings("humaneval_execute"),
        runtime=job_runtime("humaneval_execute"),
    threads: config["threads"]
    log:
        log_path("humaneval_execute", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_execute", "{run}", "{model}")
    conda:
        ENV_FILE
    script:
        "../scripts/humaneval_execute.py"
