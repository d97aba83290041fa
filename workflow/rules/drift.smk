# Routing drift of each MoE run: how fine-tuning moved the router, per MoE layer, between the base and the
# fine-tuned model on the run's coverage validation set (moeflow.evaluation.drift). Dense runs have no router: the paper
# asks for drift.json of MoE runs only (common.smk's drift_file), so the rule is never scheduled for them.


rule routing_drift:
    # Compares the routings evaluate_model kept beside its records: no model, no GPU.
    input:
        base=evaluated("base", "routing"),
        finetuned=evaluated("finetuned", "routing"),
        lib=code("routing_drift"),
    output:
        json=f"{RESULTS}/runs/{{run}}/eval/drift.json",
    params:
        settings=settings("routing_drift"),
        runtime=job_runtime("routing_drift"),
    threads: 1
    log:
        log_path("routing_drift", "{run}"),
    benchmark:
        bench_path("routing_drift", "{run}")
    conda:
        ENV_FILE
    script:
        "../scripts/routing_drift.py"
