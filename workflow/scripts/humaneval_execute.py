"""HumanEval pass@k of one model of a run: every sample's test program run in the sandbox (moeflow.sandbox,
never in this process), the greedy pass@1 and the sampled pass@k, per problem and averaged."""

from moeflow import humaneval as he
from moeflow.config import HumanEvalExecution, settings
from moeflow.files import write_json, write_text
from moeflow.sandbox import Limits, namespaces_available
from moeflow.stage import Stage

stage = Stage.from_snakemake(snakemake)
params = snakemake.params
cfg = settings(HumanEvalExecution, params.settings)
samples = he.read_samples(snakemake.input.samples)
problems = he.load_problems(params.generation["problems"])

executed = he.execute(problems, samples, Limits(wall_s=cfg.timeout_s, memory_mb=cfg.memory_mb), stage.threads)
record = he.results(problems, executed, cfg.k)
isolation = "namespaces" if namespaces_available() else "audit_hook"
record["settings"] = {"execution": params.settings, "generation": params.generation, "isolation": isolation}
record["provenance"] = stage.provenance()
write_text(snakemake.output.summary, he.summary_markdown(snakemake.wildcards.run, snakemake.wildcards.model, record))
write_json(snakemake.output.results, record)
