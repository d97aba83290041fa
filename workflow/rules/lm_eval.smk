# lm-evaluation-harness tasks (config key evaluate.tasks) on the base and the fine-tuned model of each run: one
# job per (run, model, task), so adding a task runs that task only. moeflow's own tasks (workflow/tasks/) read
# each evaluation corpus's packed test split; a task of lm-eval's registry reads its data from the local cache.


rule lm_eval_task:
    # Started through torchrun like evaluate_run, on evaluate.ranks ranks in evaluate.strategy's layout: each
    # rank holds its part of the model and scores its share of lm-eval's requests.
    input:
        model=evaluated_model_dir,
        experts=experts,
        task_files=task_files,
        eval_data=task_data,
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
        **torchrun_params("lm_eval_task"),
    resources:
        gpu=job_gpus("lm_eval_task"),
    threads: config["threads"]
    log:
        log_path("lm_eval_task", "{run}", "{model}", "{task}"),
    benchmark:
        bench_path("lm_eval_task", "{run}", "{model}", "{task}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
