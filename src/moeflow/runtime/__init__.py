"""What every stage runs on: threads, seeds, logging, the job, the device, files, the stack.

What every stage runs on: the stage's threads, seeds, logging and provenance, the torchrun job, the
device, atomic file writes, the installed stack and the environment report. Not a rerun input of any
rule: editing it changes how a stage runs, not what it computes.
"""
