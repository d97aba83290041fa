# The base model. A user's pretrained folder (model.pretrained) is used as it is; the embedded default
# first pretrains its own small MoE on the base corpus, saved with save_pretrained plus its tokenizer.


rule pretrain_base:
    input:
        tokenizer=base_tokenizer,
        data=base_corpus_data,
        experts=pretrain_experts,
        script="workflow/scripts/pretrain_base.py",
        lib=code("pretrain_base"),
    output:
        model=directory(f"{RESULTS}/base/{{basekey}}"),
    params:
        **torchrun_params("pretrain_base", checkpoints=CHECKPOINTS),
    resources:
        gpu=job_gpus("pretrain_base"),  # one rank: the base model does not depend on parallel
    threads: config["threads"]
    log:
        log_path("pretrain_base", "{basekey}"),
    benchmark:
        bench_path("pretrain_base", "{basekey}")
    conda:
        ENV_FILE
    shell:
        TORCHRUN_SHELL
