"""Evaluating a model: losses per set, lm-eval tasks, HumanEval, routing drift.

Evaluating a model: losses per set with the shared batch loop, lm-evaluation-harness tasks, HumanEval
generation and sandboxed execution, and routing drift between a base and a fine-tuned router.
"""
