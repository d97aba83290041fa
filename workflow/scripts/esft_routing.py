"""Stage esft_routing: route train.esft.token_budget tokens of the fine-tuning corpus's training split through the
base model (the coverage stage's routing pass) and write the per (layer, expert) routing totals that ESFT's
selection scores (moeflow.train.esft). The expensive part: a change to the score or top_p reuses it.
Started through torchrun by its rule, as coverage_valset: ``coverage.ranks`` ranks hold the base model in
coverage.strategy's layout (so a model trained sharded is routed sharded) and route their share of the batches;
rank 0 adds every rank's batches in order (the totals equal one rank's, bit for bit) and writes them."""

from moeflow.data.shards import iter_rows, open_split
from moeflow.evaluation.routing_stats import route_pool
from moeflow.model.routing import adapter_for
from moeflow.parallel.process_group import gather_to_main, teardown
from moeflow.runtime.files import write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.stages.forward import EsftRoutingStage, forward_layout, load_model
from moeflow.train.esft import TotalsCollector, task_rows, totals_json

job = Job.from_argv(EsftRoutingStage)
stage = Stage.start(job)
settings = job.settings
layout = forward_layout(job, stage, job.input.model)
model = load_model(job, stage, layout, job.input.model, data=[job.input.data])
adapter = adapter_for(model)
collector = TotalsCollector(adapter.moe_layers, adapter.num_experts, adapter.top_k)  # sees the routing pass
rows = task_rows(iter_rows(open_split(job.input.data, "train")), settings.token_budget)
route_pool(
    model,
    [(settings.finetune_corpus, rows)],
    settings.batch_tokens,
    settings.model.attn_implementation,
    stage.precision,
    adapter,
    observers=[collector],
    ranks=layout.ranks,
)
parts = gather_to_main(collector.batches)
if parts is not None:
    write_json(job.output.totals, {**totals_json(collector.finish(parts)), "provenance": stage.provenance()})
teardown()
