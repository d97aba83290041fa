"""The ``parallel`` section's typed settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ParallelSettings:
    """``parallel``: the torchrun ranks and how they share the model (moeflow.parallel)."""

    SCHEMA: ClassVar[str] = "#/properties/parallel"
    nproc_per_node: int
    nnodes: int
    strategy: str
    ep_size: int
    fsdp_size: int | None
    ep_implementation: str

    @property
    def world_size(self) -> int:
        """The ranks the config asks for: ``nproc_per_node x nnodes``."""
        return self.nproc_per_node * self.nnodes
