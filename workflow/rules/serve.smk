# A LoRA run's adapter as serving engines read it (serving_adapter: one adapter per expert module, part of `train`),
# and the serving check of each run: its exported model loaded in vLLM, started in the serving environment's Python
# (config key serve.python; `make serve-env`), scoring the coverage validation set against moeflow's own forward of
# the same folder, and its tensors against its base model folder's (moeflow.serving.check). Part of `paper` when
# serve.python is set; `snakemake serve` runs the checks alone. With serve.python null no job is scheduled and the
# report card says so.


rule serving_adapter:
    # Tensors split and renamed, no model: moeflow.serving.adapter.
    input:
        adapter=rules.train_model.output.adapter,
        lib=code("serving_adapter"),
    output:
        adapter=directory(f"{RESULTS}/runs/{{run}}/serve/adapter"),
    params:
        settings=settings("serving_adapter"),
        runtime=job_runtime("serving_adapter"),
    threads: 1
    log:
        log_path("serving_adapter", "{run}"),
    benchmark:
        bench_path("serving_adapter", "{run}")
    conda:
        ENV_FILE
    script:
        "../scripts/serving_adapter.py"


rule serve_check:
    # A LoRA run's serving adapter is read by vLLM's own adapter loader too (serve_check_inputs).
    input:
        unpack(serve_check_inputs),
        lib=code("serve_check"),
    output:
        json=f"{RESULTS}/runs/{{run}}/serve/check.json",
    params:
        settings=settings("serve_check"),
        runtime=job_runtime("serve_check"),
    resources:
        gpu=job_gpus("serve_check"),
    threads: config["threads"]
    log:
        log_path("serve_check", "{run}"),
    benchmark:
        bench_path("serve_check", "{run}")
    conda:
        ENV_FILE
    script:
        "../scripts/serve_check.py"


rule serve:
    # Every run's serving check (none with serve.python null).
    input:
        serve_check_files,
