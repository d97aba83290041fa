# Fine-tuning in two cached stages: warmup (the linear learning-rate warmup, a full checkpoint and a
# routing-stability gate) and train_model (cosine decay to the end, evaluations on the coverage
# validation set, the final model). Warmup is keyed by the settings it depends on, so a setting of the
# second part only (train.steps, min_lr, eval_every, ...) reruns train_model and reuses the warmup.
# Training rules start their script through torchrun (the interpreter alone at one rank): scaling out
# changes a number, not the rule. Resumable checkpoints live outside the outputs, under {RESULTS}/checkpoints.


WARMUP_PARAMS = dict(
    settings=lambda wc: stage_keys.warmup_settings(RUNS[WARMUPS[wc.warmkey]]),
    runtime=lambda wc: runtime(WARMUPS[wc.warmkey]),
    checkpoints=CHECKPOINTS,
    failed_report=lambda wc: f"{RESULTS}/logs/warmup/{wc.warmkey}.routing_report.json",
)


TRAIN_MODEL_PARAMS = dict(
    settings=lambda wc: stage_keys.train_model_settings(RUNS[wc.run]),
    # its own key: a change reruns train_model, but is no part of the checkpoints' key
    export=lambda wc: stage_keys.export_settings(RUNS[wc.run]),
    runtime=lambda wc: runtime(wc.run),
    checkpoints=CHECKPOINTS,
)


ESFT_ROUTING_PARAMS = dict(
    settings=lambda wc: stage_keys.esft_routing_settings(RUNS[ESFT_ROUTINGS[wc.routkey]]),
    device=lambda wc: RUNS[ESFT_ROUTINGS[wc.routkey]]["hardware"]["device"],
    # coverage's layout (the same routing pass): it changes no number, but starts the stage anew
    parallel=lambda wc: stage_keys.forward_parallel(RUNS[ESFT_ROUTINGS[wc.routkey]], "coverage"),
    runtime=lambda wc: runtime(ESFT_ROUTINGS[wc.routkey]),
    batch=lambda wc: stage_keys.forward_batch(RUNS[ESFT_ROUTINGS[wc.routkey]], "esft_routing"),  # its memory plan
)


rule esft_routing:
    # The expensive pass of train.method esft: the fine-tuning corpus's tokens routed through the base model.
    # Started through torchrun like coverage_valset: coverage.ranks ranks in coverage.strategy's layout.
    input:
        model=lambda wc: base_model_dir(RUNS[ESFT_ROUTINGS[wc.routkey]]),
        data=lambda wc: data_dir(RUNS[ESFT_ROUTINGS[wc.routkey]], RUNS[ESFT_ROUTINGS[wc.routkey]]["data"]["finetune_corpus"]),
        experts=lambda wc: experts_choice(RUNS[ESFT_ROUTINGS[wc.routkey]]),
        script="workflow/scripts/esft_routing.py",
        lib=code("esft_routing"),
    output:
        totals=f"{RESULTS}/esft/routing/{{routkey}}/totals.json",
    params:
        **torchrun_params("esft_routing", **ESFT_ROUTING_PARAMS),
        launcher=torchrun_launcher("esft_routing", lambda wc: RUNS[ESFT_ROUTINGS[wc.routkey]], lambda cfg: cfg["coverage"]["ranks"]),
    resources:
        gpu=lambda wc: forward_gpus(RUNS[ESFT_ROUTINGS[wc.routkey]], RUNS[ESFT_ROUTINGS[wc.routkey]]["coverage"]["ranks"]),  # common.smk's gpus_of
    threads: config["threads"]
    log:
        log_path("esft_routing", "{routkey}"),
    benchmark:
        bench_path("esft_routing", "{routkey}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL


rule esft_select:
    # Cheap: a change to train.esft.score or top_p reruns this and training, not the routing pass.
    input:
        totals=lambda wc: esft_totals(RUNS[ESFT_SELECTIONS[wc.selkey]]),
        lib=code("esft_select"),
    output:
        selection=f"{RESULTS}/esft/selection/{{selkey}}/selection.json",
        figure=report(f"{RESULTS}/esft/selection/{{selkey}}/selection.png", category="ESFT"),
    params:
        settings=lambda wc: stage_keys.esft_selection_settings(RUNS[ESFT_SELECTIONS[wc.selkey]]),
        runtime=lambda wc: runtime(ESFT_SELECTIONS[wc.selkey], torch=False),
    log:
        log_path("esft_select", "{selkey}"),
    conda:
        ENV_FILE
    script:
        "../scripts/esft_select.py"


rule warmup:
    input:
        model=lambda wc: base_model_dir(RUNS[WARMUPS[wc.warmkey]]),
        data=lambda wc: data_dir(RUNS[WARMUPS[wc.warmkey]], RUNS[WARMUPS[wc.warmkey]]["data"]["finetune_corpus"]),
        experts=lambda wc: experts_choice(RUNS[WARMUPS[wc.warmkey]]),
        selection=lambda wc: esft_selection(RUNS[WARMUPS[wc.warmkey]]),  # train.method esft only
        script="workflow/scripts/warmup.py",
        lib=code("warmup"),
    output:
        checkpoint=directory(f"{RESULTS}/warmup/{{warmkey}}"),
    params:
        **torchrun_params("warmup", **WARMUP_PARAMS),
        launcher=torchrun_launcher("warmup", lambda wc: RUNS[WARMUPS[wc.warmkey]]),
    resources:
        gpu=lambda wc: training_gpus(RUNS[WARMUPS[wc.warmkey]]),  # one rank per GPU (common.smk's gpus_of)
        nodes=lambda wc: RUNS[WARMUPS[wc.warmkey]]["parallel"]["nnodes"],
    threads: config["threads"]
    log:
        log_path("warmup", "{warmkey}"),
    benchmark:
        bench_path("warmup", "{warmkey}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL


rule train_model:
    input:
        model=lambda wc: base_model_dir(RUNS[wc.run]),
        warmup=lambda wc: warmup_dir(RUNS[wc.run]),
        data=lambda wc: data_dir(RUNS[wc.run], RUNS[wc.run]["data"]["finetune_corpus"]),
        experts=lambda wc: experts_choice(RUNS[wc.run]),
        valset=lambda wc: f"{coverage_dir(RUNS[wc.run])}/valset",
        # The memory plan gates train_model only: plan_memory's settings include all of train:, so as a
        # warmup input it would rerun warmup on a second-part change (train.steps).
        plan=lambda wc: f"{RESULTS}/runs/{wc.run}/plan.json",
        selection=lambda wc: esft_selection(RUNS[wc.run]),  # train.method esft only
        script="workflow/scripts/train_model.py",
        lib=code("train_model"),
    output:
        model=directory(f"{RESULTS}/runs/{{run}}/model"),
        logs=directory(f"{RESULTS}/runs/{{run}}/train"),
        # The peft adapter of a LoRA run (train.method: lora), next to the merged model; a full run writes
        # a method marker here, so the output always exists (moeflow.model.lora.save_adapter_output).
        adapter=directory(f"{RESULTS}/runs/{{run}}/adapter"),
    params:
        **torchrun_params("train_model", **TRAIN_MODEL_PARAMS),
        launcher=torchrun_launcher("train_model", lambda wc: RUNS[wc.run]),
    resources:
        gpu=lambda wc: training_gpus(RUNS[wc.run]),  # one rank per GPU (common.smk's gpus_of)
        nodes=lambda wc: RUNS[wc.run]["parallel"]["nnodes"],
    threads: config["threads"]
    log:
        log_path("train_model", "{run}"),
    benchmark:
        bench_path("train_model", "{run}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
