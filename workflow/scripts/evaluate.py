"""Evaluate one run: the base and the fine-tuned model on the coverage validation set and on each eval
corpus's test split (loss, perplexity, per-expert load and loss), the coverage of the validation set
rechecked with the fine-tuned router, and the throughput and peak memory of the evaluation passes."""

import gc

from moeflow.data.shards import open_split
from moeflow.data.valset import open_valset
from moeflow.evaluation import run_metrics as ev
from moeflow.model.factory import make_model
from moeflow.model.parameters import active_per_token
from moeflow.model.settings import ModelSettings
from moeflow.runtime.files import write_json, write_text
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage, kill_point
from moeflow.settings import typed

stage = Stage.start(snakemake)
params = snakemake.params
device = compute_device(params.device)

sets = [ev.EvalSet("valset", list(params.pool_corpora), open_valset(snakemake.input.valset))]
sets += [
    ev.EvalSet(f"test/{c}", [c], open_split(d, "test")) for c, d in zip(params.eval_corpora, snakemake.input.eval_data)
]

model_settings = typed(ModelSettings, params.model)
stats, speed, coverage, parameters = {}, {}, {}, {}
for label in ("base", "finetuned"):
    model = make_model(
        model_settings,
        experts=snakemake.input.experts,
        folder=snakemake.input[label],
        device=device,
        dtype=compute_dtype(stage.precision),
        data=list(snakemake.input.eval_data),
    )
    stats[label] = ev.evaluate_model(model, sets, params.settings, stage.precision)
    coverage[label] = ev.valset_coverage(model, sets[0].rows, params.coverage, stage.precision)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    parameters = {"total": sum(sizes.values()), "active_per_token": active_per_token(model.config, sizes)}
    speed[label] = ev.speed_record(stats[label].values())
    del model
    gc.collect()
    kill_point(f"evaluate.{label}")

metrics = ev.run_metrics(
    snakemake.wildcards.run, sets, stats["base"], stats["finetuned"], params.finetune_corpus, parameters
)
metrics["coverage_recheck"] = ev.coverage_recheck(coverage["base"], coverage["finetuned"], params.coverage)
metrics["provenance"] = stage.provenance()
speed["peak_memory_bytes"] = ev.peak_memory_bytes(device.type)
speed["device"] = device.type
speed["provenance"] = stage.provenance()

write_json(snakemake.output.speed, speed)
kill_point("evaluate.write")  # some outputs written, not all
write_text(snakemake.output.summary, ev.summary_markdown(metrics))
write_json(snakemake.output.metrics, metrics)
