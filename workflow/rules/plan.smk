# The memory planner: per-device memory from the model config alone, before anything is trained.
# Only the training stages depend on it, so a training setting never reruns the data stages.


rule plan_memory:
    input:
        env=rules.verify_env.output.json,
        lib=code("plan_memory"),
    output:
        json=f"{RESULTS}/runs/{{run}}/plan.json",
        md=report(f"{RESULTS}/runs/{{run}}/plan.md", caption="../report/plan_memory.rst", category="Memory plan", subcategory="{run}"),
    params:
        settings=settings("plan_memory"),
        runtime=job_runtime("plan_memory"),
    threads: 1
    log:
        log_path("plan_memory", "{run}"),
    benchmark:
        bench_path("plan_memory", "{run}")
    conda:
        ENV_FILE
    script:
        "../scripts/plan_memory.py"
