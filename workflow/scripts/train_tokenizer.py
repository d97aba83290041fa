"""Train the byte-level BPE tokenizer of a model built from config, on the train split of every source.

Saved as a folder that AutoTokenizer.from_pretrained loads, plus moeflow_tokenizer.json (what it was
trained on, provenance).
"""

from moeflow.data.tokenizer import train_tokenizer_stage
from moeflow.runtime.stage import Stage

stage = Stage.start(snakemake)
train_tokenizer_stage(
    snakemake.params.settings,
    snakemake.output[0],
    threads=stage.threads,
    provenance=stage.provenance(),
)
