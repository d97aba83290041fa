# The paper artifacts: figures (PNG and PDF), tables (CSV, Markdown, LaTeX) and provenance.json from the
# cached results of every run. Never retrains: a change to the paper's code (its script, and src/moeflow/paper:
# the rule's library input, code("paper") from moeflow.workflow.rule_code) or to a paper setting reruns this rule
# only (docs/reruns.md, checked by tests/pipeline/test_library_reruns.py).


rule paper:
    input:
        metrics=[f"{RESULTS}/runs/{run}/eval/metrics.json" for run in RUNS],
        speed=[f"{RESULTS}/runs/{run}/eval/speed.json" for run in RUNS],
        train_logs=[train_logs_dir(run) for run in RUNS],
        train_benchmarks=[bench_path("train_model", run) for run in RUNS],
        adapters=expand(rules.train_model.output.adapter, run=list(RUNS)),  # method and trainable parameters (LoRA vs full)
        evaluation=eval_result_paths,  # lm-eval, HumanEval and routing drift of every run (common.smk)
        serve=serve_check_files,  # each run's export checked in vLLM, where serve.python is set (workflow/rules/serve.smk)
        coverage=f"{coverage_dir(RUNS[config['paper']['moe_run']])}/coverage.json",
        env=rules.verify_env.output.json,
        experts=[experts_timings(RUNS[run]) for run in RUNS],  # the environment table's experts choice per run (rule choose_experts)
        data=list(paper_data().values()),
        lib=code("paper"),
    output:
        **paper_output_files(),
    params:
        runs=list(RUNS),
        data_labels=list(paper_data()),
        eval_files=eval_result_files,
        corpora=paper_corpora(),
        outdir=paper_outdir,
        settings=config["paper"],
        config=config,
        runtime=runtime(torch=False),
    threads: 1
    log:
        log_path("paper"),
    benchmark:
        bench_path("paper")
    conda:
        ENV_FILE
    script:
        "../scripts/paper.py"
