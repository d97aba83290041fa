"""Compare one run's base and fine-tuned model on every evaluation set (rule evaluate_model's records, the base
model's shared by the runs that fine-tune it): the loss's change per set, forgetting, per-expert changes, the
validation set's coverage rechecked with the fine-tuned router, and both passes' throughput and peak memory."""

from moeflow.evaluation import comparison
from moeflow.evaluation.comparison import EvaluateRunStage
from moeflow.runtime.files import read_json, write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point

job = Job.from_snakemake(snakemake, EvaluateRunStage)
stage = Stage.start(job)
settings = job.settings
records = {label: read_json(job.input[label]) for label in ("base", "finetuned")}

metrics = comparison.compare_run(settings.run, records["base"], records["finetuned"], settings.finetune_corpus)
coverage = {label: record["coverage"] for label, record in records.items()}
metrics["coverage_recheck"] = comparison.coverage_recheck(coverage["base"], coverage["finetuned"], settings.coverage)
metrics["provenance"] = stage.provenance()
speed = {label: record["speed"] for label, record in records.items()}
memory = [record["memory"] for record in records.values()]  # one per model: each its own job
speed["peak_memory_bytes"] = max(m["peak_memory_bytes"] for m in memory)
speed |= {key: memory[-1][key] for key in ("device", "ranks")}
speed["provenance"] = stage.provenance()

write_json(job.output.speed, speed)
kill_point("evaluate.write")  # some outputs written, not all
write_text(job.output.summary, comparison.summary_markdown(metrics))
write_json(job.output.metrics, metrics)
