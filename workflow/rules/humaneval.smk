# HumanEval pass@k of each run's base and fine-tuned model. Generation and execution are two rules, cached
# apart: changing a sandbox setting (timeout_s, memory_mb) or k reruns the execution only, and generated code
# runs only inside moeflow.evaluation.sandbox, never in a rule's own process.


HUMANEVAL_GENERATE_PARAMS = dict(
    settings=lambda wc: stage_keys.humaneval_generation_settings(RUNS[wc.run]),
    model=lambda wc: RUNS[wc.run]["model"],
    device=lambda wc: RUNS[wc.run]["hardware"]["device"],
    # evaluation's layout (evaluate.ranks, evaluate.strategy), as evaluate_run's: it changes no completion
    parallel=lambda wc: stage_keys.forward_parallel(RUNS[wc.run], "evaluate"),
    runtime=lambda wc: runtime(wc.run),
    batch=lambda wc: stage_keys.forward_batch(RUNS[wc.run], "humaneval_generate"),  # its memory plan
)


rule humaneval_generate:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout.
    input:
        model=evaluated_model_dir,
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        script="workflow/scripts/humaneval_generate.py",
        lib=code("humaneval_generate"),
    output:
        samples=f"{RESULTS}/runs/{{run}}/eval/humaneval/{{model}}/samples.jsonl",
    wildcard_constraints:
        model="base|finetuned",
    params:
        **torchrun_params("humaneval_generate", **HUMANEVAL_GENERATE_PARAMS),
        launcher=torchrun_launcher("humaneval_generate", lambda wc: RUNS[wc.run], lambda cfg: cfg["evaluate"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[wc.run], RUNS[wc.run]["evaluate"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("humaneval_generate", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_generate", "{run}", "{model}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL


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
        runtime=lambda wc: runtime(wc.run, torch=False),
    threads: config["threads"]
    log:
        log_path("humaneval_execute", "{run}", "{model}"),
    benchmark:
        bench_path("humaneval_execute", "{run}", "{model}")
    conda:
        ENV_FILE
    script:
        "../scripts/humaneval_execute.py"
