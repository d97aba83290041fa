# Stage 1: what environment is this? Facts only (no timestamps), so an unchanged environment gives
# the same bytes and reruns nothing downstream. The fingerprint param reruns it when packages change.

from moeflow.gpu_node import layout as gpu_layout


rule verify_env:
    input:
        env_file=f"envs/{STACK}.yaml",
        lib=lib("verify_env.py"),
    output:
        json=f"{RESULTS}/env/report.json",
        md=report(f"{RESULTS}/env/report.md", caption="../report/verify_env.rst", category="Environment"),
    params:
        env=config["env"],
        # Only the runs that turn it on: adding or removing an ordinary run must not rerun every stage.
        trust_remote_code={run: True for run, cfg in RUNS.items() if cfg["model"]["trust_remote_code"]},
        fingerprint=environment_fingerprint(),
        layout=gpu_layout(config),  # the GPU count is checked against parallel.nproc_per_node on CUDA
        runtime=runtime(),
    threads: 1
    log:
        log_path("verify_env"),
    benchmark:
        bench_path("verify_env")
    conda:
        ENV_FILE
    script:
        "../scripts/verify_env.py"
