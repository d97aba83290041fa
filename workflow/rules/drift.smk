# Routing drift of each MoE run: how fine-tuning moved the router, per MoE layer, between the base and the
# fine-tuned model on the run's coverage validation set (moeflow.evaluation.drift). Dense runs have no router: the paper
# asks for drift.json of MoE runs only (common.smk's drift_files), so the rule is never scheduled for them.


ROUTING_DRIFT_PARAMS = dict(
    settings=lambda wc: stage_keys.eval_batch_settings(RUNS[wc.run]),
    model=lambda wc: RUNS[wc.run]["model"],
    device=lambda wc: RUNS[wc.run]["hardware"]["device"],
    # evaluation's layout (evaluate.ranks, evaluate.strategy), as evaluate_run's: it changes no number
    parallel=lambda wc: stage_keys.forward_parallel(RUNS[wc.run], "evaluate"),
    runtime=lambda wc: runtime(wc.run),
    batch=lambda wc: stage_keys.forward_batch(RUNS[wc.run], "routing_drift"),  # its memory plan
)


rule routing_drift:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout.
    input:
        base=lambda wc: base_model_dir(RUNS[wc.run]),
        finetuned=lambda wc: final_model_dir(wc.run),
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        valset=lambda wc: f"{coverage_dir(RUNS[wc.run])}/valset",
        script="workflow/scripts/routing_drift.py",
        lib=code("routing_drift"),
    output:
        json=f"{RESULTS}/runs/{{run}}/eval/drift.json",
    params:
        **torchrun_params("routing_drift", **ROUTING_DRIFT_PARAMS),
        launcher=torchrun_launcher("routing_drift", lambda wc: RUNS[wc.run], lambda cfg: cfg["evaluate"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[wc.run], RUNS[wc.run]["evaluate"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("routing_drift", "{run}"),
    benchmark:
        bench_path("routing_drift", "{run}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
