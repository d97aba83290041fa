"""Stage verify_env: what environment is this, and does it match the stack's pins?"""

from moeflow import env
from moeflow.files import write_json, write_text
from moeflow.stage import Stage, kill_point

stage = Stage.from_snakemake(snakemake)  # noqa: F821 (injected by Snakemake)
params = snakemake.params  # noqa: F821

report = env.collect(
    stack=stage.stack,
    env_file=snakemake.input.env_file,  # noqa: F821
    trust_remote_code=params.trust_remote_code,
)
env.enforce(report, strict=params.env["strict"])  # strict: fails listing every difference; else warns

# No code hash or seed in the report: editing moeflow must not change its bytes, or everything
# downstream of the environment would rerun.
provenance = stage.provenance()
report["provenance"] = {k: provenance[k] for k in ("stage", "stack", "python", "torch", "transformers", "threads")}
kill_point("verify_env.write")
write_json(snakemake.output.json, report)  # noqa: F821
write_text(snakemake.output.md, env.render_markdown(report))  # noqa: F821
