# Routing drift of each MoE run: how fine-tuning moved the router, per MoE layer, between the base and the
# fine-tuned model on the run's coverage validation set (moeflow.evaluation.drift). Dense runs have no router: the paper
# asks for drift.json of MoE runs only (common.smk's drift_file), so the rule is never scheduled for them.


rule routing_drift:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout.
    input:
        base=base_model,
        finetuned=finetuned_model,
        experts=experts,
        valset=valset,
        script="workflow/scripts/routing_drift.py",
        lib=code("routing_drift"),
    output:
        json=f"{RESULTS}/runs/{{run}}/eval/drift.json",
    params:
        **torchrun_params("routing_drift"),
    resources:
        gpu=job_gpus("routing_drift"),
    threads: config["threads"]
    log:
        log_path("routing_drift", "{run}"),
    benchmark:
        bench_path("routing_drift", "{run}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
