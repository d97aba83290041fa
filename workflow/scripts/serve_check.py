"""Check that one run's exported model serves as trained: its tensors against its base model folder's, then its
prompt log-probs on the coverage validation set in vLLM (the serving environment's Python, serve.python) against
moeflow's own forward of the same folder, both in serve.dtype (moeflow.serving.check); a LoRA run's serving adapter
read by vLLM's own adapter loader, every module's factors as written (moeflow.serving.adapter). Fails, naming what
differs; writes the record otherwise. A family the engine cannot run on this device is recorded as not checked,
with the reason."""

import gc

from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.serving.settings import ServeCheckStage

# The job's GPU first (resources.gpu: moeflow.runtime.devices), before anything imports torch.
job = Job.from_snakemake(snakemake, ServeCheckStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)
settings, serve = job.settings, job.settings.serve

from moeflow.loading.factory import make_model  # noqa: E402
from moeflow.model.device import compute_device  # noqa: E402
from moeflow.runtime.files import write_json  # noqa: E402
from moeflow.runtime.stage import log  # noqa: E402
from moeflow.serving import check  # noqa: E402
from moeflow.serving.adapter import engine_read_differences  # noqa: E402
from moeflow.serving.check import ServeCheckError  # noqa: E402

record = {"run": settings.run, "model_type": check.model_type(job.input.model), "dtype": serve.dtype}

check.refuse_tensor_differences(check.tensor_differences(job.input.model, job.input.base), job.input.model)
reason = check.unsupported_reason(record["model_type"], settings.device)
if reason:
    log.warning("serve_check: %s is not checked on %s: %s", record["model_type"], settings.device, reason)
    record |= {"checked": False, "reason": reason}
else:
    sequences = check.valset_segments(job.input.valset, serve.max_sequences)
    model = make_model(
        settings.model,
        experts=job.input.experts,
        folder=job.input.model,
        device=compute_device(settings.device),
        dtype=check.DTYPES[serve.dtype],
    )
    reference = check.model_logprobs(model.eval(), sequences)
    del model
    gc.collect()  # the engine loads the model next, in its own process
    engine = check.engine_logprobs(
        serve.python, job.input.model, sequences, serve.dtype, serve.timeout_s, stage.threads
    )
    agreement = check.compare(reference, engine["sequences"], serve.tolerance)
    record |= {"checked": True, "engine": engine["engine"], "engine_version": engine["version"]}
    record |= {"engine_device": engine["device"], "sequences": len(sequences), **agreement}
    log.info("serve_check: %s", {k: v for k, v in record.items() if k != "worst"})
    if not agreement["passed"]:
        raise ServeCheckError(
            f"run {settings.run!r}: {record['engine']} {record['engine_version']} does not compute what moeflow "
            f"computes from {job.input.model} in {serve.dtype}: largest |log-prob difference| "
            f"{agreement['max_abs_logprob_diff']:.3g} (serve.tolerance {serve.tolerance:g}) at sequence "
            f"{agreement['worst']['sequence']} position {agreement['worst']['position']}, top token agreeing at "
            f"{agreement['top_token_agreement']:.1%} of {agreement['top_token_positions']} positions"
        )
if "adapter" in job.input:  # read, not run: vLLM's CPU build has no MoE LoRA kernel
    engine, read = check.engine_read_adapter(serve.python, job.input.model, job.input.adapter, serve.timeout_s)
    problems = engine_read_differences(job.input.adapter, engine, read)
    if problems:
        raise ServeCheckError(
            f"run {settings.run!r}: vLLM's adapter loader does not read {job.input.adapter} as written: "
            + "; ".join(problems[:10])
        )
    record["adapter"] = {"read_by": f"vllm {engine['version']}", "modules": len(engine["names"])}
    record["adapter"] |= {"stacked_moe_layers": len(engine["stacked"]), "scaling": engine["scaling"]}
record["provenance"] = stage.provenance()
write_json(job.output.json, record)
