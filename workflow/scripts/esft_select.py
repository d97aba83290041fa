"""Stage esft_select: ESFT's expert selection from the routing totals of rule esft_routing (moeflow.train.esft):
per MoE layer, the smallest set of experts whose relevance (train.esft.score) reaches train.esft.top_p. Writes the
selection with every score (the training stages' input) and its figure."""

from moeflow.runtime.files import read_json, write_json
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.train.esft import EsftSelectStage, select_experts, selection_figure, totals_from_json

job = Job.from_snakemake(snakemake, EsftSelectStage)
stage = Stage.start(job)
settings = job.settings
selection = select_experts(totals_from_json(read_json(job.input.totals)), settings.score, settings.top_p)
write_json(job.output.selection, {**selection, "routing": settings.routing})
selection_figure(selection, job.output.figure)
