# The base model. A user's pretrained folder (model.pretrained) is used as it is; the embedded default
# first pretrains its own small MoE on the base corpus, saved with save_pretrained plus its tokenizer.

import json
import sys


# The training rules (pretrain_base here, warmup and train_model in train.smk) are shell: rules that
# start their script through torchrun; the script reads its job with moeflow.train.job_from_argv.

def torchrun():
    """torchrun from the job's Python: the rule's conda env with --sdm conda, else Snakemake's own."""
    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    python = "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable
    # PYTHONSAFEPATH: the script's folder is not put on sys.path, where workflow/scripts/tokenize.py
    # would shadow the standard library's tokenize module.
    return f"PYTHONSAFEPATH=1 {python} -m torch.distributed.run --standalone --monitor-interval 0.5 --nproc_per_node 1"


TRAIN_SHELL = torchrun() + " {input.script:q} --job {params.job:q} --threads {threads} --log-file {log:q}"


def torchrun_job(rule, **params):
    """The script's job description (``moeflow.train.job_from_argv``): rule, inputs, outputs, params.
    Params are whole settings dicts, so Snakemake reruns the rule when one changes."""

    def job(wildcards, input, output):
        values = {k: (v(wildcards) if callable(v) else v) for k, v in params.items()}
        return json.dumps({"rule": rule, "input": dict(input.items()), "output": dict(output.items()), "params": values}, sort_keys=True)

    return job


rule pretrain_base:
    input:
        tokenizer=lambda wc: tokenizer_dir(mfconfig.tokenizer_settings(BASES[wc.basekey])),
        data=lambda wc: data_dir(BASES[wc.basekey], BASES[wc.basekey]["data"]["base_corpus"]),
        script="workflow/scripts/pretrain_base.py",
        lib=lib("collate", "tokenize", "corpus", "modeling", "routing", "losses", "guards", "evaluate", "train"),
    output:
        model=directory(f"{RESULTS}/base/{{basekey}}"),
    params:
        job=torchrun_job(
            "pretrain_base",
            settings=lambda wc: mfconfig.base_model_settings(BASES[wc.basekey]),
            runtime=lambda wc: runtime() | {"precision": BASES[wc.basekey]["precision"], "seed": BASES[wc.basekey]["seed"]},
            checkpoints=f"{RESULTS}/checkpoints",
        ),
    threads: config["threads"]
    log:
        log_path("pretrain_base", "{basekey}"),
    benchmark:
        bench_path("pretrain_base", "{basekey}")
    conda:
        ENV_FILE
    shell:
        TRAIN_SHELL
