"""Stage plan_memory: will every phase of this run's training (load, step, checkpoint, resume, export) fit in
memory? Counted from the model config alone."""

from moeflow.plan.fit import plan
from moeflow.plan.report import enforce, render_markdown, summary
from moeflow.runtime.files import read_json, write_json, write_text
from moeflow.runtime.stage import Stage, log

stage = Stage.start(snakemake)  # noqa: F821 (injected by Snakemake)

env_report = read_json(snakemake.input.env)  # noqa: F821 (the measured device memory)
plan = plan(snakemake.params.settings, env_report)  # noqa: F821
log.info("memory plan:\n%s", summary(plan))
enforce(plan)  # a phase does not fit: fails here naming it, with the numbers and what would make it fit

# No code hash: refactoring the planner must not change these bytes (and rerun training) unless the plan changes.
plan["provenance"] = {k: v for k, v in stage.provenance().items() if k != "moeflow_code"}
write_json(snakemake.output.json, plan)  # noqa: F821
write_text(snakemake.output.md, render_markdown(plan))  # noqa: F821
