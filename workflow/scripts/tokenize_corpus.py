"""Tokenize one corpus: read its source, split by content hash, pack into seq_len rows and write
Arrow shards per split plus manifest.json (see moeflow.data.shards for the row format)."""

from moeflow.data.sharding import tokenize_corpus
from moeflow.runtime.stage import Stage

stage = Stage.start(snakemake)
tokenize_corpus(
    snakemake.params.corpus,
    snakemake.params.settings,
    snakemake.input.tokenizer,
    snakemake.output[0],
    threads=stage.threads,
    provenance=stage.provenance(),
)
