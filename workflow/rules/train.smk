# Fine-tuning in two cached stages: warmup (the linear learning-rate warmup, a full checkpoint and a
# routing-stability gate) and train_model (cosine decay to the end, evaluations on the coverage
# validation set, the final model). Warmup is keyed by the settings it depends on, so a setting of the
# second part only (train.steps, min_lr, eval_every, ...) reruns train_model and reuses the warmup.
# Training rules start their script through torchrun (the interpreter alone at one rank): scaling out
# changes a number, not the rule. Resumable checkpoints live outside the outputs, under {RESULTS}/checkpoints.


rule esft_routing:
    # The expensive pass of train.method esft: the fine-tuning corpus's tokens routed through the base model.
    # Started through torchrun like coverage_valset: coverage.ranks ranks in coverage.strategy's layout.
    input:
        model=base_model,
        data=finetune_data,
        experts=experts,
        script="workflow/scripts/esft_routing.py",
        lib=code("esft_routing"),
    output:
        totals=f"{RESULTS}/esft/routing/{{routkey}}/totals.json",
    params:
        **torchrun_params("esft_routing"),
    resources:
        gpu=job_gpus("esft_routing"),
    threads: config["threads"]
    log:
        log_path("esft_routing", "{routkey}"),
    benchmark:
        bench_path("esft_routing", "{routkey}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL


rule esft_select:
    # Cheap: a change to train.esft.score or top_p reruns this and training, not the routing pass.
    input:
        totals=routing_totals,
        lib=code("esft_select"),
    output:
        selection=f"{RESULTS}/esft/selection/{{selkey}}/selection.json",
        figure=report(f"{RESULTS}/esft/selection/{{selkey}}/selection.png", category="ESFT"),
    params:
        settings=settings("esft_select"),
        runtime=job_runtime("esft_select"),
    log:
        log_path("esft_select", "{selkey}"),
    conda:
        ENV_FILE
    script:
        "../scripts/esft_select.py"


rule warmup:
    input:
        model=base_model,
        data=finetune_data,
        experts=experts,
        selection=expert_selection,  # train.method esft only
        script="workflow/scripts/warmup.py",
        lib=code("warmup"),
    output:
        checkpoint=directory(f"{RESULTS}/warmup/{{warmkey}}"),
    params:
        **torchrun_params("warmup", checkpoints=CHECKPOINTS, failed_report=warmup_report),
    resources:
        gpu=job_gpus("warmup"),  # one rank per GPU (common.smk's gpus_of)
        nodes=training_nodes,
    threads: config["threads"]
    log:
        log_path("warmup", "{warmkey}"),
    benchmark:
        bench_path("warmup", "{warmkey}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL


rule train_model:
    input:
        model=base_model,
        warmup=warmup_checkpoint,
        data=finetune_data,
        experts=experts,
        valset=valset,
        # The memory plan gates train_model only: plan_memory's settings include all of train:, so as a
        # warmup input it would rerun warmup on a second-part change (train.steps).
        plan=memory_plan,
        selection=expert_selection,  # train.method esft only
        script="workflow/scripts/train_model.py",
        lib=code("train_model"),
    output:
        model=directory(f"{RESULTS}/runs/{{run}}/model"),
        logs=directory(f"{RESULTS}/runs/{{run}}/train"),
        # The peft adapter of a LoRA run (train.method: lora), next to the merged model; a full run writes
        # a method marker here, so the output always exists (moeflow.model.lora.save_adapter_output).
        adapter=directory(f"{RESULTS}/runs/{{run}}/adapter"),
    params:
        **torchrun_params("train_model", checkpoints=CHECKPOINTS),
    resources:
        gpu=job_gpus("train_model"),  # one rank per GPU (common.smk's gpus_of)
        nodes=training_nodes,
    threads: config["threads"]
    log:
        log_path("train_model", "{run}"),
    benchmark:
        bench_path("train_model", "{run}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
