"""The order the Trainer takes training rows in (``train.order``): shuffled per epoch or sequential.

``shuffled`` takes a deterministic permutation of the rows per epoch; ``sequential`` takes the rows as they are
stored, every epoch."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class DataOrderError(ValueError):
    """No rows to take, or a saved position that belongs to other data."""


SHUFFLED, SEQUENTIAL = "shuffled", "sequential"


class DataOrder:
    """The rows of each epoch in order: a seeded permutation (``shuffled``) or as stored (``sequential``);
    the position is part of the checkpoint."""

    def __init__(self, num_rows: int, seed: int, order: str = SHUFFLED):
        if num_rows <= 0:
            raise DataOrderError("the training split has no rows: check the data stage's manifest")
        if order not in (SHUFFLED, SEQUENTIAL):
            raise DataOrderError(f"config key 'train.order': {order!r} is not one of {SHUFFLED}, {SEQUENTIAL}")
        self.num_rows, self.seed, self.order = num_rows, seed, order
        self.epoch, self.position = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if self.order == SEQUENTIAL:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            k = min(n - len(out), self.num_rows - self.position)
            out += self._perm[self.position : self.position + k]
            self.position += k
        return out

    def state_dict(self) -> dict[str, int | str]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "order": self.order,
        }

    def load_state_dict(self, state: Mapping[str, int | str]) -> None:
        saved = state.get("order", SHUFFLED)  # checkpoints from before train.order: shuffled
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed or saved != self.order:
            raise DataOrderError(
                f"checkpoint data position is for {state['num_rows']} rows/seed {state['seed']}/{saved} order, "
                f"not {self.num_rows}/{self.seed}/{self.order}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self._permutation(self.epoch)
