# lm-evaluation-harness tasks (config key evaluate.tasks) on the base and the fine-tuned model of each run: one
# job per (run, model, task), so adding a task runs that task only. moeflow's own tasks (workflow/tasks/) read
# each evaluation corpus's packed test split; a task of lm-eval's registry reads its data from the local cache.

LM_EVAL_TASK_PARAMS = dict(
    task=lambda wc: lm_eval_task_of(wc).spec,
    settings=lambda wc: RUNS[wc.run]["evaluate"]["lm_eval"],
    eval_corpora=task_corpora,
    seq_len=lambda wc: RUNS[wc.run]["data"]["seq_len"],
    model=lambda wc: RUNS[wc.run]["model"],
    label=lambda wc: wc.model,
    device=lambda wc: RUNS[wc.run]["hardware"]["device"],
    # evaluation's layout (evaluate.ranks, evaluate.strategy), as evaluate_run's: it changes no number
    parallel=lambda wc: stage_keys.forward_parallel(RUNS[wc.run], "evaluate"),
    runtime=lambda wc: runtime(wc.run),
    batch=lambda wc: stage_keys.forward_batch(RUNS[wc.run], "lm_eval_task"),  # its memory plan
)


rule lm_eval_task:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout: each
    # rank holds its part of the model and scores its share of lm-eval's requests.
    input:
        model=evaluated_model_dir,
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        # relative to the working directory: an absolute path would change (and rerun the task) in a moved copy
        task_files=lambda wc: [os.path.relpath(p) for p in lm_eval_task_of(wc).files],
        eval_data=lambda wc: [data_dir(RUNS[wc.run], c) for c in task_corpora(wc)],
        script="workflow/scripts/lm_eval_task.py",
        lib=code("lm_eval_task"),
    output:
        json=report(
            f"{RESULTS}/runs/{{run}}/eval/lm_eval/{{model}}/{{task}}.json",
            caption="../report/lm_eval.rst",
            category="Evaluation",
            subcategory="{run}",
        ),
    wildcard_constraints:
        model="base|finetuned",
        task="[A-Za-z0-9][A-Za-z0-9_.-]*",
    params:
        **torchrun_params("lm_eval_task", **LM_EVAL_TASK_PARAMS),
        launcher=torchrun_launcher("lm_eval_task", lambda wc: RUNS[wc.run], lambda cfg: cfg["evaluate"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[wc.run], RUNS[wc.run]["evaluate"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("lm_eval_task", "{run}", "{model}", "{task}"),
    benchmark:
        bench_path("lm_eval_task", "{run}", "{model}", "{task}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
