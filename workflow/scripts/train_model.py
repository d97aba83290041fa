"""Stage train_model: continue from the warmup checkpoint with cosine decay to train.steps, evaluating
on the coverage validation set; save the final model (save_pretrained + tokenizer: loadable with
AutoModelForCausalLM/AutoTokenizer.from_pretrained; LoRA adapters merged in), the adapter (a LoRA run's
peft adapter, or a full run's method marker; moeflow.lora.save_adapter_output) and the run's TensorBoard
logs and metrics.jsonl (warmup steps included). Started through torchrun by its rule: every rank runs
this script, the layout is the config's ``parallel`` section (moeflow.distributed), rank 0 writes."""

from pathlib import Path

from moeflow import distributed as D
from moeflow.config import TrainModelStage
from moeflow.files import write_json
from moeflow.lora import save_adapter_output
from moeflow.modeling import load_tokenizer, resolve_stage_experts, save_final_model
from moeflow.shards import open_split
from moeflow.stage import Stage, job_from_argv
from moeflow.train import train_stage
from moeflow.valset import open_valset

snakemake = job_from_argv(settings=TrainModelStage)
stage = Stage.from_snakemake(snakemake)
snakemake.settings = resolve_stage_experts(snakemake.settings, snakemake.input.experts)
settings = snakemake.settings
ranks, model = D.start_fine_tuning(snakemake, stage.precision)
tokenizer = load_tokenizer(snakemake.input.model)
trainer = train_stage(
    stage,
    model,
    settings.train,
    open_split(snakemake.input.data, "train"),
    attn_implementation=settings.model["attn_implementation"],
    log_dir=snakemake.output.logs,
    checkpoint_root=snakemake.params.checkpoints,
    key_settings=snakemake.params.settings,
    key_inputs=[snakemake.input.model, snakemake.input.data, snakemake.input.warmup, snakemake.input.valset],
    start_from=snakemake.input.warmup,
    eval_rows=open_valset(snakemake.input.valset),
)
model = D.whole_model(trainer.model)  # a collective when sharded: the whole weights on rank 0, for saving
if trainer.rank == 0:
    last = trainer.train_records()[-1]
    evals = [r for r in trainer.history if r["kind"] == "eval"]
    write_json(
        Path(snakemake.output.logs) / "summary.json",
        {
            "steps": trainer.step,
            "final": {k: last[k] for k in ("loss", "ce", "balance_loss", "balance_global", "z_loss", "lr")},
            "eval": [{k: r[k] for k in ("step", "loss", "perplexity")} for r in evals],
            "alarms": [a for r in trainer.train_records() for a in r.get("alarms", [])],
            "routing": trainer.routing_guard.report(),
            "provenance": stage.provenance(),
        },
    )
    save_adapter_output(model, snakemake.output.adapter)  # before the merge, which consumes a LoRA wrapper
    save_final_model(model, tokenizer, snakemake.output.model)
trainer.remove_checkpoints()
D.teardown()
