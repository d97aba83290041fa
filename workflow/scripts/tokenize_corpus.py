"""Tokenize one corpus: read its source, split by content hash, pack into seq_len rows and write
Arrow shards per split plus manifest.json (see moeflow.data.shards for the row format)."""

from moeflow.data.sharding import tokenize_corpus
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

# The settings go to the library whole: the manifest records them as the rule passed them (keys.data_settings).
job = Job.from_snakemake(snakemake)
stage = Stage.start(job)
tokenize_corpus(
    job.params.corpus,
    job.params.settings,
    job.input.tokenizer,
    job.output.shards,
    threads=stage.threads,
    provenance=stage.provenance(),
)
