"""One lm-eval task on one model of a run (base or fine-tuned) through lm-evaluation-harness
(moeflow.evaluation.lm_eval_run):
its metrics with lm-eval's standard errors and, for moeflow's perplexity task, the cross-check against
moeflow's own perplexity of the same test segments."""

import tempfile

from moeflow.evaluation import lm_eval_run as harness
from moeflow.evaluation.lm_eval_tasks import TaskSpecError, missing_data_files, resolve
from moeflow.model.factory import load_model, resolve_experts
from moeflow.model.folder import load_tokenizer
from moeflow.runtime.files import write_json
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage, kill_point

stage = Stage.from_snakemake(snakemake)
params = snakemake.params
settings = params.settings
harness.require_lm_eval()

# Everything that can fail on the task's input fails here, before a model is loaded.
where = f"evaluate.tasks entry {params.task!r}"
task = resolve(params.task, where)
problems = missing_data_files(task, where)
if problems:
    raise TaskSpecError("; ".join(problems))
max_length = settings["max_length"] or params.seq_len
tokenizer = load_tokenizer(snakemake.input.model, params.model["trust_remote_code"])
corpus_dirs = dict(zip(params.eval_corpora, snakemake.input.eval_data))
documents = (
    harness.corpus_documents(task, corpus_dirs, tokenizer, settings, max_length, stage.seed) if task.docs else {}
)

device = compute_device(params.device)
model_cfg = resolve_experts(params.model, snakemake.input.experts)
model = load_model(snakemake.input.model, model_cfg, compute_dtype(stage.precision)).to(device).eval()
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
