"""Stage choose_experts: time one MoE block under each experts implementation at the run's layer shape, on
its device, in its precision and as its layout holds the experts (moeflow.model.experts_choice); write the
choice, which the rules that load the model take as input, and the timings, which only the reports read."""

from moeflow.model.settings import ExpertsChoiceStage
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

# The job's GPU first (resources.gpu: moeflow.runtime.devices), before anything imports torch: CUDA reads
# CUDA_VISIBLE_DEVICES once, at the first device query, which transformers' import may make.
job = Job.from_snakemake(snakemake, ExpertsChoiceStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)
settings = job.settings

from moeflow.model import experts_choice  # noqa: E402
from moeflow.model.device import compute_device  # noqa: E402
from moeflow.runtime.files import write_json  # noqa: E402

report = experts_choice.measure(
    settings.model,
    settings.micro_batch_size,
    settings.seq_len,
    compute_device(settings.device),
    settings.precision,
    strategy=settings.parallel.strategy,
    ep_size=settings.parallel.ep_size,
)
write_json(job.output.timings, report | {"provenance": stage.provenance()})
write_json(job.output.choice, experts_choice.choice_record(report))
