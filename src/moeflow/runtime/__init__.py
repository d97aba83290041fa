"""What every stage runs on: threads, logging, the job, GPU claims, files, the stack; nothing that computes.

In full: the stage's threads, logging and provenance, the torchrun job, GPU claims, atomic file writes,
host-to-device copies, the installed stack and the environment report. Not a rerun input of
any rule, so nothing here may change a number in an output: code that does lives with its concern
(moeflow.workflow.rule_code's ``PLUMBING`` lists what computing code may use of this).
"""
