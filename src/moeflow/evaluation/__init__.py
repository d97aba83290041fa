"""Evaluating a model: losses per set, lm-eval tasks, HumanEval, routing drift.

The losses per set use the shared batch loop; the lm-eval tasks run through lm-evaluation-harness; HumanEval
covers generation and sandboxed execution; routing drift is between a base and a fine-tuned router.
"""
