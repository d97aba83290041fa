"""One lm-eval task on one model of a run (base or fine-tuned) through lm-evaluation-harness
(moeflow.evaluation.lm_eval_run):
its metrics with lm-eval's standard errors and, for moeflow's perplexity task, the cross-check against
moeflow's own perplexity of the same test segments."""

import tempfile

from moeflow.evaluation import lm_eval_run as harness
from moeflow.evaluation.lm_eval_tasks import TaskSpecError, missing_data_files, resolve
from moeflow.model.factory import make_model
from moeflow.model.folder import load_tokenizer
from moeflow.model.settings import ModelSettings
from moeflow.runtime.files import write_json
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage, kill_point
from moeflow.settings import typed

stage = Stage.start(snakemake)
params = snakemake.params
settings = params.settings
model_settings = typed(ModelSettings, params.model)
harness.require_lm_eval()

# Everything that can fail on the task's input fails here, before a model is loaded.
where = f"evaluate.tasks entry {params.task!r}"
task = resolve(params.task, where)
problems = missing_data_files(task, where)
if problems:
    raise TaskSpecError("; ".join(problems))
max_length = settings["max_length"] or params.seq_len
tokenizer = load_tokenizer(snakemake.input.model, model_settings.trust_remote_code)
corpus_dirs = dict(zip(params.eval_corpora, snakemake.input.eval_data))
documents = (
    harness.corpus_documents(task, corpus_dirs, tokenizer, settings, max_length, stage.seed) if task.docs else {}
)

model = make_model(
    model_settings,
    experts=snakemake.input.experts,
    folder=snakemake.input.model,
    device=compute_device(params.device),
    dtype=compute_dtype(stage.precision),
).eval()
kill_point("lm_eval_task.loaded")
if task.docs:
    with tempfile.TemporaryDirectory() as workdir:
        record = harness.corpus_task_record(
            model, tokenizer, task, documents, settings, max_length, stage.seed, stage.precision, workdir
        )
else:
    record = harness.task_record(model, tokenizer, task, settings, max_length, stage.seed)

write_json(
    snakemake.output.json,
    {
        "task": params.task,
        "model": snakemake.wildcards.model,
        **record,
        "settings": settings,
        "provenance": stage.provenance(),
    },
)
