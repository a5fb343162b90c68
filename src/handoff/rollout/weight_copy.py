"""The engine's weight writes, batched: many (destination, source) copies in few launches.

    copy_in_batches((dest, src, nbytes) for ...)

A sync of a few hundred tensors is bound by the host's work per tensor, so the engine's
load_weights queues its copies as one `_foreach_copy_` per LOAD_BATCH_BYTES instead of a
launch per tensor. The run's calibration copies the same way, to time what a sync costs.
"""

from __future__ import annotations

from typing import Iterable

import torch

LOAD_BATCH_BYTES = 256 << 20


def copy_in_batches(copies: Iterable[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """dest.copy_(src) for each (dest, src, bytes), one `_foreach_copy_` per LOAD_BATCH_BYTES."""
    dests, srcs, pending = [], [], 0
    for dest, src, nbytes in copies:
        dests.append(dest)
        srcs.append(src)
        pending += nbytes
        if pending >= LOAD_BATCH_BYTES:
            torch._foreach_copy_(dests, srcs)
            dests, srcs, pending = [], [], 0
    if dests:
        torch._foreach_copy_(dests, srcs)
