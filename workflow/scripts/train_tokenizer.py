"""Train the byte-level BPE tokenizer of a model built from config, on the train split of every source.

Saved as a folder that AutoTokenizer.from_pretrained loads, plus moeflow_tokenizer.json (what it was
trained on, provenance).
"""

from moeflow.data.tokenizer import TrainTokenizerStage, train_tokenizer_stage
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage

job = Job.from_snakemake(snakemake, TrainTokenizerStage)
stage = Stage.start(job)
train_tokenizer_stage(
    job.settings,
    job.output.tokenizer,
    threads=stage.threads,
    provenance=stage.provenance(),
)
