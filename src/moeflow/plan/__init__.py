"""The memory planner: shapes, parameter counts, memory per rank and phase, the scale-out plan.

The memory planner: model shapes from a config, parameter counts, memory per rank in every phase of a
training job, and the scale-out plan for a SLURM profile. No torch at import time.
"""
