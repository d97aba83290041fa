"""Tokenize one corpus: read its source, split by content hash, pack into seq_len rows and write
Arrow shards per split plus manifest.json (see moeflow.data.shards for the row format)."""

from moeflow.data.sharding import TokenizeStage, tokenize_corpus
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

job = Job.from_snakemake(snakemake, TokenizeStage)
stage = Stage.start(job)
tokenize_corpus(
    job.params.corpus,
    job.settings,
    job.input.tokenizer,
    job.output.shards,
    threads=stage.threads,
    provenance=stage.provenance(),
)
