"""Stage train_model: continue from the warmup checkpoint with cosine decay to train.steps, evaluating on the coverage
validation set; save the final model (HF-sharded safetensors streamed one tensor at a time by
moeflow.checkpoint.export, with the base folder's config.json, tokenizer and other files: loadable with
AutoModelForCausalLM/AutoTokenizer.from_pretrained and a drop-in for the base folder; LoRA adapters merged in; MTP
layers carried), the adapter (a LoRA run's peft adapter, or a full run's method marker;
moeflow.model.lora.save_adapter_output) and the run's TensorBoard logs, metrics.jsonl (warmup steps included),
summary.json (whether MTP layers trained, the optimizer state's bytes) and phase_peaks.json (each phase's peak memory
on every rank, warmup's and this stage's, which the report card sets beside the memory plan's). Started through
torchrun by its rule: every rank runs this script, the layout is the config's ``parallel`` section
(moeflow.loading.factory.Layout), rank 0 writes."""

from pathlib import Path

from moeflow.checkpoint.export import ExportSettings, export_dtype, save_final_model
from moeflow.data.shards import open_split
from moeflow.data.valset import open_valset
from moeflow.families.mtp import mtp_report
from moeflow.loading.factory import Layout, make_model
from moeflow.model.lora import save_adapter_output
from moeflow.model.wrappers import unwrap
from moeflow.parallel.process_group import gather_objects, teardown
from moeflow.runtime.files import read_json, write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.settings import typed
from moeflow.train.peak_memory import PHASE_PEAKS_FILE, PhasePeaks, by_phase
from moeflow.train.settings import TrainModelStage
from moeflow.train.trainer import train_stage

job = Job.from_argv(TrainModelStage)
stage = Stage.start(job)
settings = job.settings
export = typed(ExportSettings, settings.export)
layout = Layout.join(settings.parallel, settings.hardware_device, settings.train, stage.precision)
# the data first: its libraries are part of the rank's runtime in every phase, as the memory plan counts it
rows, eval_rows = open_split(job.input.data, "train"), open_valset(job.input.valset)
peaks = PhasePeaks(layout.ranks.device)
# the warmup checkpoint (start_from) replaces every weight: the base model's are not read (weights=False), so the
# model's allocation is part of the memory plan's resume phase, as the checkpoint read into it that follows
with peaks.measure("resume"):
    model = make_model(
        settings.model,
        experts=job.input.experts,
        folder=job.input.model,
        layout=layout,
        weights=False,
        data=[job.input.data],
    )
# train.method esft: rule esft_select's experts (the only ones that train); its file keys the checkpoints too
selection = read_json(job.input.selection) if settings.train.method == "esft" else None
selection_inputs = [job.input.selection] if selection else []
trainer = train_stage(
    stage,
    model,
    settings.train,
    rows,
    log_dir=job.output.logs,
    checkpoint_root=job.params.checkpoints,
    key_settings={k: v for k, v in job.params.settings.items() if k != "export"},  # export: no part of the key
    key_inputs=[job.input.model, job.input.data, job.input.warmup, job.input.valset, *selection_inputs],
    start_from=job.input.warmup,
    eval_rows=eval_rows,
    expert_selection=selection,
    peaks=peaks,
)
optimizer_state_bytes = trainer.optimizer_state_bytes()  # every rank: a collective
if trainer.rank == 0:
    last = trainer.train_records()[-1]
    evals = [r for r in trainer.history if r["kind"] == "eval"]
    write_json(
        Path(job.output.logs) / "summary.json",
        {
            "steps": trainer.step,
            "final": {k: last[k] for k in ("loss", "ce", "balance_loss", "balance_global", "z_loss", "lr")},
            "eval": [{k: r[k] for k in ("step", "loss", "perplexity")} for r in evals],
            "alarms": [a for r in trainer.train_records() for a in r.get("alarms", [])],
            "routing": trainer.routing_guard.report(),
            # the base model's MTP layers, carried frozen into the export (null: it has none)
            "mtp_layers": mtp_report(unwrap(trainer.model)),
            # the training method's memory beyond the weights (the paper's methods table)
            "optimizer_state_bytes": optimizer_state_bytes,
            "provenance": stage.provenance(),
        },
    )
trainer.free_optimizer()  # the export gathers weights where AdamW's states were
with peaks.measure("export"):
    save_adapter_output(unwrap(trainer.model), job.output.adapter, trainer.expert_mask)  # every rank: it gathers
    # every rank; the base folder's config, tokenizer and other files go with the weights (a drop-in for it)
    save_final_model(
        trainer.model,
        None,
        job.output.model,
        export.max_shard_size,
        source=job.input.model,
        dtype=export_dtype(export.dtype, job.input.model, trainer.model),
    )
measured = by_phase(gather_objects(peaks.bytes))  # every rank: a collective
if trainer.rank == 0:
    warmup = Path(job.input.warmup) / PHASE_PEAKS_FILE  # absent from a checkpoint an older moeflow wrote
    stages = {"warmup": read_json(warmup)["bytes"] if warmup.is_file() else {}, "train_model": measured}
    write_json(Path(job.output.logs) / PHASE_PEAKS_FILE, {"device": layout.ranks.device.type, "stages": stages})
trainer.remove_checkpoints()
teardown()
