# The base model. A user's pretrained folder (model.pretrained) is used as it is; the embedded default
# first pretrains its own small MoE on the base corpus, saved with save_pretrained plus its tokenizer.


rule pretrain_base:
    input:
        tokenizer=lambda wc: tokenizer_dir(stage_keys.tokenizer_settings(BASES[wc.basekey])),
        data=lambda wc: data_dir(BASES[wc.basekey], BASES[wc.basekey]["data"]["base_corpus"]),
        experts=lambda wc: experts_choice(BASES[wc.basekey], "pretrain"),
        script="workflow/scripts/pretrain_base.py",
        lib=code("pretrain_base"),
    output:
        model=directory(f"{RESULTS}/base/{{basekey}}"),
    params:
        job=torchrun_job(
            "pretrain_base",
            settings=lambda wc: stage_keys.base_model_settings(BASES[wc.basekey]),
            runtime=lambda wc: runtime() | {"precision": BASES[wc.basekey]["precision"], "seed": BASES[wc.basekey]["seed"]},
            checkpoints=f"{RESULTS}/checkpoints",
        ),
        launcher=torchrun_launcher("pretrain_base"),  # the rule's GPUs, else one CPU rank: the base model does not depend on parallel
    resources:
        gpu=lambda wc: gpus_of(BASES[wc.basekey]),  # one rank: the base model does not depend on parallel
    threads: config["threads"]
    log:
        log_path("pretrain_base", "{basekey}"),
    benchmark:
        bench_path("pretrain_base", "{basekey}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
