"""Overlap with the next forward: blocks wait for their own pulls, not for every pull.

Every call of a ``ScheduledKVStore`` returns once its pulls are queued on the kv thread (MXNet's
engine orders by queue time, see :mod:`bytescheduler.mxnet.backend`). After
:meth:`ForwardOverlap.register`, a ``pushpull`` whose outputs all belong to the registered
parameters returns at once instead, and the forward pre-hook of each block waits until the
pulls of the block's own parameters are queued: communication of the last layers overlaps the
forward of the first ones. A hybridized block runs as one graph, and MXNet only calls the hook
of the outermost hybridized block: that hook waits for all parameters under it (no overlap
inside it).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Set, Tuple

from .backend import Job


class ForwardOverlap:
    """The forward pre-hooks of one store, and which job writes each array they wait for.

    ``wait_queued(job)`` waits until ``job``'s pulls are queued (and raises its error).
    """

    def __init__(self, wait_queued: Callable[[Job], None]) -> None:
        self._wait_queued = wait_queued
        self._lock = threading.Lock()
        self._latest: Dict[int, Tuple[Any, Job]] = {}  # id(out array) -> (array, job)
        self._params: List[Any] = []
        self._ids: Set[int] = set()

    def record(self, jobs: Iterable[Job]) -> None:
        """Note the jobs as the latest writers of their output arrays."""
        with self._lock:
            for job in jobs:
                for arr in job.outs:
                    self._latest[id(arr)] = (arr, job)

    def register(self, net: Any) -> List[Any]:
        """Add a forward pre-hook to ``net`` and every child block; return the hook handles."""
        handles = []
        blocks = []

        def walk(block):
            blocks.append(block)
            for child in block._children.values():
                walk(child() if isinstance(child, weakref.ref) else child)
        walk(net)
        for block in blocks:
            own = list(getattr(block, "_reg_params", {}).values())
            every = list(block.collect_params().values())
            self._params.extend(own)
            handles.append(block.register_forward_pre_hook(
                lambda blk, _inputs, own=own, every=every: self._wait_params(
                    every if getattr(blk, "_active", False) else own)))
        self._ids.clear()
        return handles

    def _wait_params(self, params: List[Any]) -> None:
        jobs = []
        with self._lock:
            for param in params:
                for arr in (param._data or []):
                    entry = self._latest.get(id(arr))
                    if entry is not None and entry[0] is arr:
                        jobs.append(entry[1])
        for job in jobs:
            self._wait_queued(job)

    def covered(self, outs: List[Any], values: List[Any]) -> bool:
        """True when every output belongs to a parameter whose blocks wait for it."""
        if not self._params or any(o is v for o in outs for v in values):
            return False
        if not all(id(o) in self._ids for o in outs):
            self._ids = {id(arr) for p in self._params for arr in (p._data or [])}
        return all(id(o) in self._ids for o in outs)
