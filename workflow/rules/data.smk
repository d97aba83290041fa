# Tokenization: a tokenizer (trained here for a model built from config), then one packed Arrow shard
# set per corpus and split, keyed by the data settings so that runs that agree on data share it.


rule train_tokenizer:
    input:
        lib=code("train_tokenizer"),
    output:
        tokenizer=directory(f"{RESULTS}/tokenizer/{{tokkey}}"),
    params:
        settings=tokenizer_settings,
        runtime=runtime(torch=False),
    threads: config["threads"]
    log:
        log_path("train_tokenizer", "{tokkey}"),
    benchmark:
        bench_path("train_tokenizer", "{tokkey}")
    conda:
        ENV_FILE
    script:
        "../scripts/train_tokenizer.py"


rule tokenize:
    input:
        tokenizer=data_tokenizer,
        sources=corpus_files,
        lib=code("tokenize"),
    output:
        shards=directory(f"{RESULTS}/data/{{datakey}}/{{corpus}}"),
    params:
        settings=data_settings,
        corpus="{corpus}",
        runtime=runtime(torch=False),
    threads: config["threads"]
    log:
        log_path("tokenize", "{datakey}", "{corpus}"),
    benchmark:
        bench_path("tokenize", "{datakey}", "{corpus}")
    conda:
        ENV_FILE
    script:
        "../scripts/tokenize_corpus.py"
