# The expert-coverage validation set: route the held-out pool through the base model and pick
# documents so that every (layer, expert) and the frequent expert pairs are exercised.


rule coverage_valset:
    # Started through torchrun like evaluate_run: coverage.ranks ranks hold the base model in coverage.strategy's
    # layout (fsdp: sharded, loaded as training loads it) and share the pool's batches; one rank by default. The
    # layout changes no number (tests/pipeline/test_sharded_coverage.py), but starts the stage anew.
    input:
        model=base_model,
        experts=pretrain_experts,
        pool=pool_data,
        script="workflow/scripts/coverage_valset.py",
        lib=code("coverage_valset"),
    output:
        valset=directory(f"{RESULTS}/coverage/{{covkey}}/valset"),
        json=f"{RESULTS}/coverage/{{covkey}}/coverage.json",
        heatmap=report(f"{RESULTS}/coverage/{{covkey}}/heatmap.png", caption="../report/coverage.rst", category="Coverage"),
    params:
        **torchrun_params("coverage_valset"),
    resources:
        gpu=job_gpus("coverage_valset"),
    threads: config["threads"]
    log:
        log_path("coverage_valset", "{covkey}"),
    benchmark:
        bench_path("coverage_valset", "{covkey}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
