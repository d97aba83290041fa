"""Stage verify_env: what environment is this, and does it match the stack's pins?"""

from moeflow.runtime import env, gpu_node
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage, kill_point

job = Job.from_snakemake(snakemake, env.VerifyEnvStage)  # noqa: F821 (injected by Snakemake)
stage = Stage.start(job)
settings = job.settings

report = env.collect(stack=stage.stack, env_file=job.input.env_file, trust_remote_code=settings.trust_remote_code)
report["gpu_node"] = gpu_node.check(settings.layout)  # driver, GPU count vs layout, NCCL all-reduce
env.enforce(report, strict=settings.strict)  # strict: fails listing every difference; else warns
gpu_node.enforce(report["gpu_node"], strict=settings.strict)

# No code hash or seed in the report: editing moeflow must not change its bytes, or everything
# downstream of the environment would rerun.
provenance = stage.provenance()
report["provenance"] = {k: provenance[k] for k in ("stage", "stack", "python", "torch", "transformers", "threads")}
kill_point("verify_env.write")
write_json(job.output.json, report)
write_text(job.output.md, env.render_markdown(report) + "\n" + gpu_node.render_markdown(report["gpu_node"]))
