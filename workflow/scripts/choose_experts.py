"""Stage choose_experts: time one MoE block under each experts implementation at the run's layer shape, on
its device, in its precision and as its layout holds the experts (moeflow.model.experts_choice); write the
choice, which the rules that load the model take as input, and the timings, which only the reports read."""

from moeflow.runtime.stage import Stage

# The job's GPU first (resources.gpu: moeflow.runtime.devices), before anything imports torch: CUDA reads
# CUDA_VISIBLE_DEVICES once, at the first device query, which transformers' import may make.
stage = Stage.start(snakemake)  # noqa: F821 (injected by Snakemake)

from moeflow.model import experts_choice  # noqa: E402
from moeflow.model.device import compute_device  # noqa: E402
from moeflow.model.settings import ModelSettings  # noqa: E402
from moeflow.runtime.files import write_json  # noqa: E402
from moeflow.settings import typed  # noqa: E402

settings = snakemake.params.settings  # noqa: F821 (moeflow.workflow.keys.experts_settings)

report = experts_choice.measure(
    typed(ModelSettings, settings["model"]),
    settings["micro_batch_size"],
    settings["seq_len"],
    compute_device(settings["device"]),
    settings["precision"],
    strategy=settings["parallel"]["strategy"],
    ep_size=settings["parallel"]["ep_size"],
)
write_json(snakemake.output.timings, report | {"provenance": stage.provenance()})  # noqa: F821
write_json(snakemake.output.choice, experts_choice.choice_record(report))  # noqa: F821
