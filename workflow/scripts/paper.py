"""The paper artifacts: figures (PNG, PDF) and tables (CSV, Markdown, LaTeX) from the cached results of
every run (training logs, evaluation metrics, lm-eval tasks, HumanEval, routing drift, coverage,
environment), each carrying its provenance."""

from moeflow.paper.build import PaperStage, write_paper
from moeflow.paper.eval_results import read_run_results, stage_documents
from moeflow.paper.inputs import RunRecord, read_benchmark, read_train_log
from moeflow.runtime.files import read_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

job = Job.from_snakemake(snakemake, PaperStage)
Stage.start(job)
inp, params = job.input, job.params

records = {
    run: RunRecord(
        name=run,
        metrics=read_json(metrics),
        speed=read_json(speed),
        log=read_train_log(f"{logs}/metrics.jsonl"),
        benchmark=read_benchmark(bench),
        training=read_json(f"{adapter}/trainable_parameters.json"),  # moeflow.model.lora.REPORT_FILE
        results=read_run_results(
            params.corpora[run]["general"], params.corpora[run]["target"], **params.eval_files[run]
        ),
        summary=read_json(f"{logs}/summary.json"),
    )
    for run, metrics, speed, logs, bench, adapter in zip(
        params.runs, inp.metrics, inp.speed, inp.train_logs, inp.train_benchmarks, inp.adapters
    )
}
manifests = {label: f"{folder}/manifest.json" for label, folder in zip(params.data_labels, inp.data)}
stage_docs = {f"evaluate/{run}": r.metrics for run, r in records.items()}
stage_docs |= {f"tokenize/{label}": read_json(path) for label, path in manifests.items()}
stage_docs |= {f"train_model/{run}": r.summary for run, r in records.items()}
for run, r in records.items():
    stage_docs |= stage_documents(run, r.results)
stage_docs["coverage"] = coverage = read_json(inp.coverage)
stage_docs["verify_env"] = read_json(inp.env)

write_paper(
    params.outdir,
    config=params.config,
    settings=job.settings,
    records=records,
    coverage=coverage,
    env_report_path=inp.env,
    manifests=manifests,
    stage_docs=stage_docs,
    experts={run: read_json(timings) for run, timings in zip(params.runs, inp.experts)},
)
