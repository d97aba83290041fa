"""HumanEval pass@k of one model of a run: every sample's test program run in the sandbox (moeflow.evaluation.sandbox,
never in this process), the greedy pass@1 and the sampled pass@k, per problem and averaged."""

from moeflow.evaluation import humaneval as he
from moeflow.evaluation.humaneval import HumanEvalExecution
from moeflow.evaluation.humaneval_execution import execute
from moeflow.evaluation.sandbox import Limits, namespaces_available
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.stage import Stage
from moeflow.settings import typed

stage = Stage.start(snakemake)
params = snakemake.params
cfg = typed(HumanEvalExecution, params.settings["execution"])
samples = he.read_samples(snakemake.input.samples)
problems = he.load_problems(params.settings["generation"]["problems"])

executed = execute(problems, samples, Limits(wall_s=cfg.timeout_s, memory_mb=cfg.memory_mb), stage.threads)
record = he.results(problems, executed, cfg.k)
isolation = "namespaces" if namespaces_available() else "audit_hook"
record["settings"] = params.settings | {"isolation": isolation}
record["provenance"] = stage.provenance()
write_text(snakemake.output.summary, he.summary_markdown(snakemake.wildcards.run, snakemake.wildcards.model, record))
write_json(snakemake.output.results, record)
