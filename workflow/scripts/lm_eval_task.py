"""One lm-eval task on one model of a run (base or fine-tuned) through lm-evaluation-harness
(moeflow.evaluation.lm_eval_run):
its metrics with lm-eval's standard errors and, for moeflow's perplexity task, the cross-check against
moeflow's own perplexity of the same test segments.
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold the model in evaluate.strategy's layout
(moeflow.loading.factory.Layout: fsdp shards it as training does), each scores its share of lm-eval's requests
(moeflow.evaluation.lm_eval_run.share_requests); rank 0 writes the record. With evaluate.lm_eval.engine vllm, lm-eval's
vLLM backend scores the exported folder in the serving environment instead (moeflow.serving.harness), one process."""

import tempfile

from moeflow.evaluation import lm_eval_run as harness
from moeflow.evaluation.lm_eval_tasks import TaskSpecError, missing_data_files, resolve
from moeflow.model.folder import load_tokenizer
from moeflow.parallel.process_group import teardown
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point
from moeflow.serving.harness import engine_task_record
from moeflow.stages.forward import LmEvalTaskStage, forward_layout, load_model

job = Job.from_argv(LmEvalTaskStage)
stage = Stage.start(job)
settings = job.settings.lm_eval
harness.require_lm_eval()

# Everything that can fail on the task's input fails here, before a model is loaded.
where = f"evaluate.tasks entry {job.settings.task!r}"
task = resolve(job.settings.task, where)
problems = missing_data_files(task, where)
if problems:
    raise TaskSpecError("; ".join(problems))
max_length = settings["max_length"] or job.settings.seq_len
tokenizer = load_tokenizer(job.input.model, job.settings.model.trust_remote_code)
corpus_dirs = dict(zip(job.settings.eval_corpora, job.input.eval_data))
documents = (
    harness.corpus_documents(task, corpus_dirs, tokenizer, settings, max_length, stage.seed) if task.docs else {}
)

if settings["engine"] == "vllm":  # the model as it will be served (one process)
    with tempfile.TemporaryDirectory() as workdir:
        record = engine_task_record(
            job.settings.serving,
            job.input.model,
            task,
            documents,
            settings,
            max_length,
            stage.seed,
            workdir,
            stage.threads,
        )
    is_main = True
else:
    layout = forward_layout(job, stage, job.input.model)
    model = load_model(job, stage, layout, job.input.model).eval()
    kill_point("lm_eval_task.loaded")
    if task.docs:
        with tempfile.TemporaryDirectory() as workdir:
            record = harness.corpus_task_record(
                model,
                tokenizer,
                task,
                documents,
                settings,
                max_length,
                stage.seed,
                stage.precision,
                workdir,
                layout.ranks,
            )
    else:
        record = harness.task_record(model, tokenizer, task, settings, max_length, stage.seed, layout.ranks)
    record["engine"] = {"name": "hf", "dtype": stage.precision}
    is_main = layout.ranks.is_main

if is_main:
    write_json(
        job.output.json,
        {
            "task": job.settings.task,
            "model": job.settings.label,
            **record,
            "settings": settings,
            "provenance": stage.provenance(),
        },
    )
teardown()
