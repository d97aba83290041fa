# Stage 1: what environment is this? Facts only (no timestamps), so an unchanged environment gives
# the same bytes and reruns nothing downstream. The fingerprint param reruns it when packages change.

rule verify_env:
    input:
        env_file=f"envs/{STACK}.yaml",
        lib=code("verify_env"),
    output:
        json=f"{RESULTS}/env/report.json",
        md=report(f"{RESULTS}/env/report.md", caption="../report/verify_env.rst", category="Environment"),
    params:
        settings=stage_keys.verify_env_settings(config, RUNS),
        fingerprint=environment_fingerprint(),
        runtime=runtime(torch=False),
    threads: 1
    log:
        log_path("verify_env"),
    benchmark:
        bench_path("verify_env")
    conda:
        ENV_FILE
    script:
        "../scripts/verify_env.py"


# The experts implementation that model.experts_implementation: auto stands for, chosen by timing one MoE block
# of the run's shape on its device and precision (moeflow.model.experts_choice). One job per distinct shape, device and
# precision (common.smk's EXPERTS), so runs that share a model share it. The choice (no timings) is an input of
# every rule that loads the model; the timings only of the paper, so their run-to-run noise reruns nothing.
rule choose_experts:
    input:
        model_config=model_config_file,
        lib=code("choose_experts"),
    output:
        choice=f"{RESULTS}/experts/{{expkey}}/choice.json",
        timings=f"{RESULTS}/experts/{{expkey}}/timings.json",
    params:
        settings=experts_settings,
        fingerprint=environment_fingerprint(),  # new packages time again (the choice reruns training only if it changes)
        runtime=runtime(),
    wildcard_constraints:
        expkey="e-[0-9a-f]+",
    resources:
        gpu=experts_gpus,  # times one MoE block on one GPU
    threads: config["threads"]
    log:
        log_path("choose_experts", "{expkey}"),
    benchmark:
        bench_path("choose_experts", "{expkey}")
    conda:
        ENV_FILE
    script:
        "../scripts/choose_experts.py"
