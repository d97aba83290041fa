"""Stage esft_select: ESFT's expert selection from the routing totals of rule esft_routing (moeflow.train.esft):
per MoE layer, the smallest set of experts whose relevance (train.esft.score) reaches train.esft.top_p. Writes the
selection with every score (the training stages' input) and its figure."""

from moeflow.runtime.files import read_json, write_json
from moeflow.runtime.stage import Stage
from moeflow.train.esft import select_experts, selection_figure, totals_from_json

stage = Stage.start(snakemake)
settings = snakemake.params.settings  # moeflow.workflow.keys.esft_selection_settings
selection = select_experts(totals_from_json(read_json(snakemake.input.totals)), settings["score"], settings["top_p"])
write_json(snakemake.output.selection, {**selection, "routing": settings["routing"]})
selection_figure(selection, snakemake.output.figure)
