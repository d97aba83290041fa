"""Forward passes in step across ranks: every rank runs as many forwards as the rank that runs the most.

Under FSDP every forward gathers parameters, and under expert parallelism it exchanges tokens: collectives every
rank must join. Where the number of forwards a rank runs depends on its data (lm-eval's batches, a generation's
stopping), :func:`forwards_in_step` keeps the ranks paired forward for forward with filler inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from moeflow.parallel.process_group import gather_floats


def any_rank(working: bool) -> bool:
    """Whether any rank is ``working`` (one small all-reduce every rank takes part in)."""
    return any(gather_floats(float(working)))


@contextlib.contextmanager
def forwards_in_step(model: Any, filler: Any) -> Iterator[None]:
    """Every rank runs as many forwards of ``model`` as the rank that runs the most.

    Before each of its forwards in the body a rank says so (an all-reduce); a rank done with the body then
    runs ``filler`` (input ids) through the model, its output dropped, for as long as another rank still
    announces forwards. ``model`` is the module whose ``__call__`` the body's forwards go through (``generate``
    calls its model's own). On an error in the body no filler runs (the other ranks would wait for this one;
    torchrun stops them)."""
    import torch

    def announce(module, args, kwargs):
        any_rank(True)

    # prepended: before FSDP2's own pre-forward hook, whose parameter gather is the first collective
    handle = model.register_forward_pre_hook(announce, prepend=True, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
    with torch.no_grad():
        while any_rank(False):
            model(filler)
