# HumanEval pass@k of each run's base and fine-tuned model. Generation and execution are two rules, cached
# apart: changing a sandbox setting (timeout_s, memory_mb) or k reruns the execution only, and generated code
# runs only inside moeflow.evaluation.sandbox, never in a rule's own process.


rule humaneval_generate:
    input:
        model=evaluated_model_dir,
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        lib=code("humaneval_generate"),
    output:
        samples=f"{RESULTS}/runs/{{run}}/eval/humaneval/{{model}}/samples.jsonl",
    wildcard_constraints:
        model="base|finetuned",
    params:
        settings=lambda wc: stage_keys.humaneval_generation_settings(RUNS[wc.run]),
        model=lambda wc: RUNS[wc.run]["model"],
        device=lambda wc: RUNS[wc.run]["hardware"]["device"],
        runtime=lambda wc: runtime(wc.run),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[wc.run]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("humaneval_generate", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_generate", "{run}", "{model}")
    conda:
        ENV_FILE
    script:
        "../scripts/humaneval_generate.py"


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
        settings=lambda wc: stage_keys.humaneval_execution_settings(RUNS[wc.run]),
        generation=lambda wc: stage_keys.humaneval_generation_settings(RUNS[wc.run]),
        runtime=lambda wc: runtime(wc.run),
    threads: config["threads"]
    log:
        log_path("humaneval_execute", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_execute", "{run}", "{model}")
    conda:
        ENV_FILE
    script:
        "../scripts/humaneval_execute.py"
