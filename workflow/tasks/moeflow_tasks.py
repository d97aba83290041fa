"""Functions the task YAMLs of this folder name with ``!function``: lm-eval imports this file from here.

The documents of moeflow's corpus tasks are written by the lm_eval stage (moeflow.evaluation.lm_eval_run), which passes
their file through lm-eval's task metadata; outside that stage these tasks have no data.

Nothing of moeflow is imported: the serving environment's lm-eval runs these tasks too (``evaluate.lm_eval.engine:
vllm``), and moeflow is not installed there.
"""

import json

DOCS_FILE = "moeflow_docs_file"  # the metadata key naming the documents (moeflow.evaluation.lm_eval_docs.DOCS_FILE)


def docs(**metadata):
    """The task's test split from the documents file the stage named in the task metadata."""
    import datasets

    if DOCS_FILE not in metadata:
        raise ValueError(
            "moeflow's corpus tasks get their documents from moeflow's lm_eval stage (rule lm_eval_task); "
            "run them through it (evaluate.tasks in the config), not from the lm-eval command line"
        )
    with open(metadata[DOCS_FILE], encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})


def token_perplexity(doc, results):
    """A segment's log-likelihood and the tokens it predicts: lm-eval's ``weighted_perplexity`` of these is
    exp(-sum of log-likelihoods / sum of tokens), moeflow's perplexity over the same tokens."""
    return {"token_perplexity": (float(results[0]), int(doc["labels"]))}
