# The expert-coverage validation set: route the held-out pool through the base model and pick
# documents so that every (layer, expert) and the frequent expert pairs are exercised.


COVERAGE_VALSET_PARAMS = dict(
    settings=lambda wc: stage_keys.coverage_settings(COVERAGES[wc.covkey]),  # the coverage key's settings
    device=lambda wc: COVERAGES[wc.covkey]["hardware"]["device"],
    # the layout changes no number (tests/pipeline/test_sharded_coverage.py), but starts the stage anew
    parallel=lambda wc: stage_keys.forward_parallel(COVERAGES[wc.covkey], "coverage"),
    runtime=runtime(),
    batch=lambda wc: stage_keys.forward_batch(COVERAGES[wc.covkey], "coverage_valset"),  # its memory plan
)


rule coverage_valset:
    # Started through torchrun like evaluate_run: coverage.ranks ranks hold the base model in coverage.strategy's
    # layout (fsdp: sharded, loaded as training loads it) and share the pool's batches; one rank by default.
    input:
        model=lambda wc: base_model_dir(COVERAGES[wc.covkey]),
        experts=lambda wc: experts_choice(COVERAGES[wc.covkey], "pretrain"),
        pool=lambda wc: [data_dir(COVERAGES[wc.covkey], c) for c in COVERAGES[wc.covkey]["coverage"]["pool_corpora"]],
        script="workflow/scripts/coverage_valset.py",
        lib=code("coverage_valset"),
    output:
        valset=directory(f"{RESULTS}/coverage/{{covkey}}/valset"),
        json=f"{RESULTS}/coverage/{{covkey}}/coverage.json",
        heatmap=report(f"{RESULTS}/coverage/{{covkey}}/heatmap.png", caption="../report/coverage.rst", category="Coverage"),
    params:
        **torchrun_params("coverage_valset", **COVERAGE_VALSET_PARAMS),
        launcher=torchrun_launcher("coverage_valset", lambda wc: COVERAGES[wc.covkey], lambda cfg: cfg["coverage"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(COVERAGES[wc.covkey], COVERAGES[wc.covkey]["coverage"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("coverage_valset", "{covkey}"),
    benchmark:
        bench_path("coverage_valset", "{covkey}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
