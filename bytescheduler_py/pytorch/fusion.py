"""Fusion buffers: the flat buffers merged pieces are copied into, reused instead of allocated anew.

A merged operation's size depends on which gradients happened to be ready together, so it
changes from step to step. Allocated anew each time, buffers of ever new sizes fragment
malloc's heaps: with the thresholds ScheduledOptimizer raises (:mod:`heap`, so gradient
memory stays mapped) they all come from the heaps, and a 2-rank soak of ScheduledOptimizer
with every step scheduled kept growing (RSS +6.5-9.2 MiB over 10,000 steps, all of it
memory malloc held free, none in use; docs/reliability.md). :class:`FusionBuffers` keeps
buffers in power-of-two sizes and hands them out again, so the heaps see a few sizes, once.

>>> buffers = FusionBuffers()
>>> a = buffers.take(300, torch.float32, torch.device("cpu"))
>>> a.numel(), a.storage_offset()
(300, 0)
>>> buffers.give_back(a)
>>> b = buffers.take(400, torch.float32, torch.device("cpu"))   # the same 512-element buffer
>>> b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
True
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import torch

# The fewest elements a buffer has: smaller merges share one size.
_MIN_NUMEL = 1 << 12
# Free buffers kept per size; more are let go (the credit bounds how many are in flight).
_KEEP_PER_SIZE = 8

_Key = Tuple[int, torch.dtype, torch.device]


def _size_class(numel: int) -> int:
    return max(_MIN_NUMEL, 1 << (numel - 1).bit_length())


class FusionBuffers:
    """Reusable flat buffers in power-of-two sizes, per dtype and device.

    :meth:`take` (the dispatcher) returns a view of exactly the size asked; :meth:`give_back`
    (gloo's thread, once the operation finished) returns its buffer for the next merge. One
    lock guards the free lists.
    """

    def __init__(self) -> None:
        self._free: Dict[_Key, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (its contents undefined), from a reused buffer."""
        key = (_size_class(numel), dtype, device)
        with self._lock:
            free = self._free.get(key)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = torch.empty(key[0], dtype=dtype, device=device)
        return buffer[:numel]

    def give_back(self, view: torch.Tensor) -> None:
        """Return the buffer under ``view`` (from :meth:`take`) once nothing uses its contents."""
        buffer = view._base if view._base is not None else view
        key = (buffer.numel(), buffer.dtype, buffer.device)
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < _KEEP_PER_SIZE:
                free.append(buffer)
