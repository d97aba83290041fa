"""Stage train_model: continue from the warmup checkpoint with cosine decay to train.steps, evaluating
on the coverage validation set; save the final model (save_pretrained + tokenizer: loadable with
AutoModelForCausalLM/AutoTokenizer.from_pretrained; LoRA adapters merged in) and the run's TensorBoard logs and metrics.jsonl
(warmup steps included)."""

from pathlib import Path

from moeflow.coverage import open_valset
from moeflow.io import write_json
from moeflow.modeling import load_model, load_tokenizer
from moeflow.stage import Stage
from moeflow.tokenize import open_split
from moeflow.train import TrainSettings, init_distributed, job_from_argv, prepare_model, save_final_model, train_stage

snakemake = job_from_argv()
stage = Stage.from_snakemake(snakemake)
device = init_distributed()
settings = snakemake.params.settings  # {"train": ..., "model": ..., "warmup": warmup key}

model = prepare_model(load_model(snakemake.input.model, settings["model"]).to(device), settings["train"])
tokenizer = load_tokenizer(snakemake.input.model)
trainer = train_stage(
    stage, model, TrainSettings.from_config(settings["train"]), open_split(snakemake.input.data, "train"),
    attn_implementation=settings["model"]["attn_implementation"],
    log_dir=snakemake.output.logs,
    checkpoint_root=snakemake.params.checkpoints,
    key_settings=settings,
    key_inputs=[snakemake.input.model, snakemake.input.data, snakemake.input.warmup, snakemake.input.valset],
    start_from=snakemake.input.warmup,
    eval_rows=open_valset(snakemake.input.valset),
)
if trainer.rank == 0:
    last = trainer.train_records()[-1]
    evals = [r for r in trainer.history if r["kind"] == "eval"]
    write_json(Path(snakemake.output.logs) / "summary.json", {
        "steps": trainer.step,
        "final": {k: last[k] for k in ("loss", "ce", "balance_loss", "balance_global", "z_loss", "lr")},
        "eval": [{k: r[k] for k in ("step", "loss", "perplexity")} for r in evals],
        "alarms": [a for r in trainer.train_records() for a in r.get("alarms", [])],
        "routing": trainer.routing_guard.report(),
        "provenance": stage.provenance(),
    })
    save_final_model(model, tokenizer, snakemake.output.model)
trainer.remove_checkpoints()
