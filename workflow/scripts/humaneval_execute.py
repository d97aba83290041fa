"""HumanEval pass@k of one model of a run: every sample's test program run in the sandbox (moeflow.evaluation.sandbox,
never in this process), the greedy pass@1 and the sampled pass@k, per problem and averaged."""

from moeflow.evaluation import humaneval as he
from moeflow.evaluation.humaneval import HumanEvalExecuteStage
from moeflow.evaluation.humaneval_execution import execute
from moeflow.evaluation.sandbox import Limits, namespaces_available
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

job = Job.from_snakemake(snakemake, HumanEvalExecuteStage)
stage = Stage.start(job)
execution = job.settings.execution
samples = he.read_samples(job.input.samples)
problems = he.load_problems(job.settings.generation.problems)

limits = Limits(wall_s=execution.timeout_s, memory_mb=execution.memory_mb)
record = he.results(problems, execute(problems, samples, limits, stage.threads), execution.k)
isolation = "namespaces" if namespaces_available() else "audit_hook"
record["settings"] = job.params.settings | {"isolation": isolation}  # as the rule passed them
record["provenance"] = stage.provenance()
write_text(job.output.summary, he.summary_markdown(job.wildcards.run, job.wildcards.model, record))
write_json(job.output.results, record)
