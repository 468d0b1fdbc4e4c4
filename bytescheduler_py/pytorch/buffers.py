"""Buffers as DDP keeps them: rank 0's copied to every rank before each training forward.

``DistributedDataParallel(broadcast_buffers=True)`` (its default) broadcasts the model's
buffers (BatchNorm's running statistics, its batch counter) from rank 0 at the start of a
forward that follows a training forward, so every rank evaluates, checkpoints and stops
with rank 0's statistics updated by its own last batch. :class:`BufferSync` does the same
for a plain model trained by ScheduledOptimizer: the same forwards, the same source, over
a process group the scheduler does not use on its own threads.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .read_guard import suspended


class BufferSync:
    """Broadcasts ``model``'s buffers from ``source`` (a global rank) over ``group`` before
    each forward of the root module that DDP would sync at.

    DDP syncs before the first forward, then before any forward that follows one run with
    gradients enabled and a gradient sync due; with ``passes`` backward passes accumulated
    per step (DDP's ``no_sync`` for the first ``passes - 1``), that is the first forward of
    each step. ``step()`` calls :meth:`step_called`.
    """

    def __init__(self, model: torch.nn.Module, group: Any, source: int, passes: int = 1) -> None:
        self._model = model
        self._group = group
        self._source = source
        self._passes = passes
        self._forwards = 0  # training forwards since the last step()
        self._due = True
        # Closures, not bound methods: a deep copy of the model (an EMA copy, DDP's baseline
        # in a test) copies its hooks, and this object holds a process group.
        self._handles = [
            model.register_forward_pre_hook(lambda module, inputs: self._before(), prepend=True),
            model.register_forward_hook(lambda module, inputs, output: self._after()),
        ]

    def _before(self) -> None:
        if self._due:
            buffers = list(self._model.buffers())
            if buffers:
                broadcast_buffers(buffers, self._source, self._group)

    def _after(self) -> None:
        if torch.is_grad_enabled():
            self._forwards += 1
            self._due = self._forwards % self._passes == 0
        else:
            self._due = False

    def step_called(self) -> None:
        self._forwards = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@torch.no_grad()
def broadcast_buffers(buffers: List[torch.Tensor], source: int, group: Any) -> None:
    """Copy ``source``'s ``buffers`` to every rank of ``group``: one broadcast per dtype and
    device (as DDP coalesces them), leaving the buffers' version counters as they were."""
    kinds: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = defaultdict(list)
    for buffer in buffers:
        kinds[(buffer.dtype, buffer.device)].append(buffer)
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    with suspended():
        for same in kinds.values():
            if len(same) == 1:
                flat = same[0]
            else:
                flat = _flatten_dense_tensors(same)
            dist.broadcast(flat, src=source, group=group)
            if flat is same[0]:
                continue
            for buffer, value in zip(same, _unflatten_dense_tensors(flat, same)):
                if preserve is not None:
                    with preserve(buffer):
                        buffer.copy_(value)
                else:
                    buffer.copy_(value)
