"""Stage pretrain_base (embedded default only): train the small MoE from config on the base corpus's
train split, and save it as save_pretrained would (moeflow.checkpoint.export, with the schema's export.max_shard_size:
the embedded default is far smaller) plus its tokenizer, like any user's pretrained model.
Started through torchrun by its rule (see workflow/rules/model.smk): one rank per GPU of the rule's
resources, one CPU rank otherwise; every rank holds the whole model (parallel.strategy: none) and rank 0
writes the output."""

import contextlib
from pathlib import Path

from moeflow.checkpoint.export import ExportSettings, write_model_folder
from moeflow.data.shards import open_split
from moeflow.loading.factory import Layout, make_model
from moeflow.model.folder import load_tokenizer
from moeflow.parallel.process_group import init, teardown
from moeflow.runtime.files import atomic_dir, write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.settings import typed
from moeflow.train.settings import PretrainStage
from moeflow.train.trainer import train_stage

job = Job.from_argv(PretrainStage)
stage = Stage.start(job)
settings = job.settings
ranks = init()
tokenizer = load_tokenizer(job.input.tokenizer)
model = make_model(
    settings.model,
    experts=job.input.experts,
    vocab_size=len(tokenizer),
    seed=stage.seed,
    layout=Layout.replicated(ranks),
)
for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
    setattr(model.config, name, getattr(tokenizer, name))
rows = open_split(job.input.data, "train")

with atomic_dir(job.output.model) if ranks.is_main else contextlib.nullcontext() as out:
    trainer = train_stage(
        stage,
        model,
        settings.pretrain,
        rows,
        log_dir=Path(out) / "training" if ranks.is_main else None,
        checkpoint_root=job.params.checkpoints,
        key_settings=job.params.settings,
        key_inputs=[job.input.tokenizer, job.input.data],
    )
    if trainer.rank == 0:
        write_model_folder(model, tokenizer, out, typed(ExportSettings, {}).max_shard_size)
        last = trainer.train_records()[-1]
        write_json(
            Path(out) / "training" / "summary.json",
            {
                "steps": trainer.step,
                "final": {k: last[k] for k in ("loss", "ce", "balance_loss", "balance_global", "z_loss")},
                "routing": trainer.routing_guard.report(),
                "provenance": stage.provenance(),
            },
        )
trainer.remove_checkpoints()
teardown()
