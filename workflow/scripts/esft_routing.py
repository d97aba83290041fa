"""Stage esft_routing: route train.esft.token_budget tokens of the fine-tuning corpus's training split through the
base model (the coverage stage's routing pass) and write the per (layer, expert) routing totals that ESFT's
selection scores (moeflow.train.esft). The expensive part: a change to the score or top_p reuses it.
Started through torchrun by its rule, as coverage_valset: ``coverage.ranks`` ranks hold the base model in
coverage.strategy's layout (so a model trained sharded is routed sharded) and route their share of the batches;
rank 0 adds every rank's batches in order (the totals equal one rank's, bit for bit) and writes them."""

from moeflow.data.shards import iter_rows, open_split
from moeflow.model.device import compute_dtype
from moeflow.model.factory import Layout, make_model
from moeflow.model.routing import adapter_for
from moeflow.model.routing_stats import route_pool
from moeflow.model.settings import ModelSettings
from moeflow.parallel.process_group import gather_to_main, teardown
from moeflow.parallel.settings import ParallelSettings
from moeflow.plan.forward import refuse_unless_fits
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.settings import typed
from moeflow.train.esft import TotalsCollector, task_rows, totals_json

job = Job.from_argv()
stage = Stage.start(job)
settings = job.params.settings  # moeflow.workflow.keys.esft_routing_settings
layout = Layout.join(typed(ParallelSettings, job.params.parallel), job.params.device, None, stage.precision)
refuse_unless_fits(job.params.batch, settings["model"], job.input.model, layout)  # its memory plan, before the load
model_settings = typed(ModelSettings, settings["model"])
model = make_model(
    model_settings,
    experts=job.input.experts,
    folder=job.input.model,
    layout=layout,
    dtype=compute_dtype(stage.precision),
    data=[job.input.data],
)
adapter = adapter_for(model)
collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)  # sees the routing pass
rows = task_rows(iter_rows(open_split(job.input.data, "train")), settings["token_budget"])
route_pool(
    model,
    [(settings["finetune_corpus"], rows)],
    settings["batch_tokens"],
    model_settings.attn_implementation,
    stage.precision,
    adapter,
    observers=[collector],
    ranks=layout.ranks,
)
parts = gather_to_main(collector.batches)
if parts is not None:
    write_json(job.output.totals, {**totals_json(collector.finish(parts)), "provenance": stage.provenance()})
teardown()
