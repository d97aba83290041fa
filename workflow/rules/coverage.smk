# The expert-coverage validation set: route the held-out pool through the base model and pick
# documents so that every (layer, expert) and the frequent expert pairs are exercised.

rule coverage_valset:
    input:
        model=lambda wc: base_model_dir(COVERAGES[wc.covkey]),
        experts=lambda wc: experts_choice(COVERAGES[wc.covkey], "pretrain"),
        pool=lambda wc: [data_dir(COVERAGES[wc.covkey], c) for c in COVERAGES[wc.covkey]["coverage"]["pool_corpora"]],
        lib=code("coverage_valset"),
    output:
        valset=directory(f"{RESULTS}/coverage/{{covkey}}/valset"),
        json=f"{RESULTS}/coverage/{{covkey}}/coverage.json",
        heatmap=report(f"{RESULTS}/coverage/{{covkey}}/heatmap.png", caption="../report/coverage.rst", category="Coverage"),
    params:
        settings=lambda wc: stage_keys.coverage_settings(COVERAGES[wc.covkey]),
        device=lambda wc: COVERAGES[wc.covkey]["hardware"]["device"],
        runtime=runtime(),
    resources:
        gpu=lambda wc: forward_gpus(COVERAGES[wc.covkey]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("coverage_valset", "{covkey}"),
    benchmark:
        bench_path("coverage_valset", "{covkey}")
    conda:
        ENV_FILE
    script:
        "../scripts/coverage_valset.py"
