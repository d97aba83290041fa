"""Ranks and layouts: the process group, FSDP and expert parallelism, gradients, per-rank loading.

Ranks and layouts: the process group torchrun describes, FSDP and expert-parallel sharding, gradient
reduction and clipping across ranks, each rank reading its own rows of the weight files, the torchrun
command.
"""
