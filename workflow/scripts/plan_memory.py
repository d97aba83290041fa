"""Stage plan_memory: will every phase of this run's training (load, step, checkpoint, resume, export) fit in
memory? Counted from the model config alone."""

from moeflow.plan.memory import PlanMemoryStage
from moeflow.plan.report import enforce, render_markdown, summary
from moeflow.plan.training_plan import plan
from moeflow.runtime.files import read_json, write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, log

job = Job.from_snakemake(snakemake, PlanMemoryStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)

env_report = read_json(job.input.env)  # the measured device memory
plan = plan(job.settings, env_report)
log.info("memory plan:\n%s", summary(plan))
enforce(plan)  # a phase does not fit: fails here naming it, with the numbers and what would make it fit

# No code hash: refactoring the planner must not change these bytes (and rerun training) unless the plan changes.
plan["provenance"] = {k: v for k, v in stage.provenance().items() if k != "moeflow_code"}
write_json(job.output.json, plan)
write_text(job.output.md, render_markdown(plan))
