"""Ranks and layouts: the process group, FSDP and expert parallelism, gradients, per-rank loading.

The process group is the one torchrun describes; gradients are reduced and clipped across ranks; each rank reads
its own rows of the weight files. The package also holds the torchrun command.
"""
