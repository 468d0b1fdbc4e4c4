"""Ending cleanly: know what gloo's threads still have to let go of, and wait for it.

A gloo thread takes the GIL after running an operation: to free the done-callback it
ran, and to drop the reference torch keeps to a tensor's Python object while C++ holds
the tensor. If the training script has ended by then and the interpreter is being torn
down, the thread is made to exit inside a C++ destructor and the process aborts
("terminate called without an active exception"). :class:`Keeper` tracks both, and
:meth:`Keeper.wait_idle` (when a scheduler's groups are released, and at exit) waits
until gloo has let go of everything.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable, List

import torch


class Keeper:
    """Knows what gloo's threads still have to let go of, so the process can wait for it.

    - every callback we hand to torch is wrapped; the wrapper drops its closure as soon as
      it has run (inside the call, where a thread may exit harmlessly) and is recorded, in
      a set changed by single calls (never blocking, never letting go of the GIL), from
      the moment it runs until it is freed;
    - every tensor handed to gloo is watched through a weak reference from its launch on:
      it dies when gloo lets go of it (we hold no other reference, so memory is reused as
      soon as before).

    :meth:`wait_idle` (when the groups are released, and at exit) waits for both, also
    for operations still in flight after a failure (gloo fails them within its timeout).
    A cancelled receive's buffer, which gloo never lets go of, is kept for the life of
    the process and not waited for.
    """

    def __init__(self) -> None:
        self._live: set = set()
        self._tensors: List["weakref.ReferenceType[torch.Tensor]"] = []
        self._lock = threading.Lock()
        _KEEPERS.add(self)

    def wrap(self, fn: Callable[[Any], None]) -> "TrackedCallback":
        return TrackedCallback(fn, self._live)

    def watch(self, tensor: torch.Tensor) -> None:
        """Remember ``tensor`` until gloo has let go of it."""
        with self._lock:
            self._tensors = [ref for ref in self._tensors if ref() is not None]
            self._tensors.append(weakref.ref(tensor))

    def _busy(self) -> bool:
        with self._lock:
            self._tensors = [ref for ref in self._tensors if ref() is not None]
            return bool(self._live or self._tensors)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until gloo's threads let go of everything; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._busy():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True


class TrackedCallback:
    __slots__ = ("_fn", "_live")

    def __init__(self, fn: Callable[[Any], None], live: set) -> None:
        self._fn = fn
        self._live = live

    def __call__(self, future: Any) -> None:
        fn, self._fn = self._fn, None
        if fn is None:
            return
        self._live.add(id(self))
        fn(future)

    def __del__(self) -> None:
        self._live.discard(id(self))


_KEEPERS: "weakref.WeakSet[Keeper]" = weakref.WeakSet()


@atexit.register
def _wait_for_gloo() -> None:
    # Runs before the interpreter is torn down, also when a script never closes its
    # scheduler; 5 s in all bounds it if a backend thread is stuck.
    deadline = time.monotonic() + 5.0
    for keeper in list(_KEEPERS):
        keeper.wait_idle(max(0.0, deadline - time.monotonic()))
