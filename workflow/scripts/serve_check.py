"""Check that one run's exported model serves as trained (moeflow.serving.check): its tensors against its base model
folder's, then its prompt log-probs on the coverage validation set in vLLM (the serving environment's Python,
serve.python) against moeflow's own forward of the same folder, both in serve.dtype; and a LoRA run's serving adapter
read by vLLM's own adapter loader, every module's factors as written (moeflow.serving.adapter). Fails, naming what
differs; writes the record otherwise. A family the engine cannot run on this device is recorded as not checked."""

from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.serving.settings import ServeCheckStage

# The job's GPU first (resources.gpu: moeflow.runtime.devices), before anything imports torch.
job = Job.from_snakemake(snakemake, ServeCheckStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)
settings = job.settings

from moeflow.runtime.files import write_json  # noqa: E402
from moeflow.serving.adapter import check_serving_adapter  # noqa: E402
from moeflow.serving.check import check_export  # noqa: E402

inputs = job.input
record = check_export(settings, inputs.model, inputs.base, inputs.experts, inputs.valset, stage.threads)
if "adapter" in inputs:  # read, not run: vLLM's CPU build has no MoE LoRA kernel
    record["adapter"] = check_serving_adapter(
        settings.serve.python, inputs.model, inputs.adapter, settings.serve.timeout_s
    )
record["provenance"] = stage.provenance()
write_json(job.output.json, record)
