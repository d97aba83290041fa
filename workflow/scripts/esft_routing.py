"""Stage esft_routing: route train.esft.token_budget tokens of the fine-tuning corpus's training split through the
base model (the coverage stage's routing pass) and write the per (layer, expert) routing totals that ESFT's
selection scores (moeflow.train.esft). The expensive part: a change to the score or top_p reuses it."""

from moeflow.data.shards import iter_rows, open_split
from moeflow.model.factory import make_model
from moeflow.model.routing import adapter_for
from moeflow.model.routing_stats import route_pool
from moeflow.model.settings import ModelSettings
from moeflow.runtime.files import write_json
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage
from moeflow.settings import typed
from moeflow.train.esft import TotalsCollector, task_rows, totals_json

stage = Stage.start(snakemake)
settings = snakemake.params.settings  # moeflow.workflow.keys.esft_routing_settings
model_settings = typed(ModelSettings, settings["model"])
model = make_model(
    model_settings,
    experts=snakemake.input.experts,
    folder=snakemake.input.model,
    device=compute_device(snakemake.params.device),
    dtype=compute_dtype(stage.precision),
    data=[snakemake.input.data],
)
adapter = adapter_for(model)
collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)  # sees the routing pass
rows = task_rows(iter_rows(open_split(snakemake.input.data, "train")), settings["token_budget"])
route_pool(
    model,
    [(settings["finetune_corpus"], rows)],
    settings["batch_tokens"],
    model_settings.attn_implementation,
    stage.precision,
    adapter,
    observers=[collector],
)
write_json(snakemake.output.totals, {**totals_json(collector.finish()), "provenance": stage.provenance()})
