"""Functions the task YAMLs of this folder name with ``!function``: lm-eval imports this file from here.

The documents of moeflow's corpus tasks are written by the lm_eval stage (moeflow.evaluation.lm_eval_run), which passes
their file through lm-eval's task metadata; outside that stage these tasks have no data.
"""

from moeflow.evaluation.lm_eval_docs import docs_dataset, token_perplexity_items


def docs(**metadata):
    return docs_dataset(metadata)


def token_perplexity(doc, results):
    return token_perplexity_items(doc, results)
