"""A LoRA run's adapter in the layout serving engines read: every fused routed-expert adapter split into one adapter
per expert module under the model files' names, exactly, at rank r; a peft config naming the adapted modules
(moeflow.serving.adapter). vLLM's MoE LoRA loader reads it (rule serve_check checks that with vLLM's own code)."""

from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, log
from moeflow.serving.settings import ServingAdapterStage

job = Job.from_snakemake(snakemake, ServingAdapterStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)

from moeflow.serving.adapter import write_serving_adapter  # noqa: E402

written = write_serving_adapter(job.input.adapter, job.output.adapter)
log.info("serving adapter of run %s: %s", job.settings.run, written)
