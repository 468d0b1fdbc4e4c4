"""The read guard: torch operations on the training thread wait for parameters still in flight.

With cross-iteration overlap a parameter's update may land while the next forward runs.
A module's forward pre-hook waits for its own parameters; :class:`ReadGuard`, a
``TorchFunctionMode`` pushed on the training thread, covers every other read (tied
weights, parameters used outside their module's forward, ``p.grad`` read for clipping):
at the first torch operation that reads a parameter whose update or communication is
pending, it waits for it.

The guard is pushed when the first :class:`~bytescheduler.pytorch.overlap.OverlapEngine`
of a thread attaches and popped when the last engine detaches on that thread. Modes form
a per-thread stack, so it is popped only when it is on top (popping out of order would
remove someone else's mode); otherwise, or when the last engine closes on another thread,
it stays, inert: with no engine attached it costs one attribute read per torch call, and
the next engine on that thread reuses it.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional, Protocol, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

_DATA_ATTRIBUTES = {"data", "grad", "T", "mT", "H", "mH", "real", "imag"}


class Guarded(Protocol):
    """What the guard needs of an engine (:class:`~bytescheduler.pytorch.overlap.OverlapEngine`)."""

    busy: int  # parameters with an update or communication pending
    guard_thread: Optional[int]  # the thread whose guard the engine installed

    def wait_if_pending(self, tensor: torch.Tensor, gradient_only: bool) -> None: ...


class _ThreadState(threading.local):
    suspended = 0
    guard: Optional["ReadGuard"] = None


_local = _ThreadState()


class ReadGuard(TorchFunctionMode):
    """Waits, on its thread, for parameters whose update or communication is pending."""

    # Attached engines: a tuple, replaced (never changed in place) under _lock, so the
    # guard reads it without a lock.
    engines: Tuple[Guarded, ...] = ()
    _lock = threading.Lock()

    @classmethod
    def attach(cls, engine: Guarded, install: bool) -> None:
        """Let ``engine``'s parameters be guarded; ``install``: push the guard on this thread."""
        with cls._lock:
            cls.engines = cls.engines + (engine,)
        if install:
            engine.guard_thread = threading.get_ident()
            if _local.guard is None:
                guard = cls()
                guard.__enter__()
                _local.guard = guard

    @classmethod
    def detach(cls, engine: Guarded) -> None:
        """Stop guarding ``engine``; pop this thread's guard when no engine here needs it."""
        with cls._lock:
            cls.engines = tuple(e for e in cls.engines if e is not engine)
            here = threading.get_ident()
            needed = any(getattr(e, "guard_thread", None) == here for e in cls.engines)
        guard = _local.guard
        if guard is not None and not needed and _get_current_function_mode() is guard:
            guard.__exit__(None, None, None)
            _local.guard = None

    @staticmethod
    def installed() -> bool:
        """Whether this thread has the guard pushed."""
        return _local.guard is not None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Compiled code reads no engine state (dynamo would guard on it and recompile as
        # it changes); what a compiled graph reads was waited for before it ran (compiled.py).
        if not torch.compiler.is_compiling():
            for engine in ReadGuard.engines:
                if engine.busy:
                    if not _local.suspended:
                        _wait_for(func, args, kwargs)
                    break
        return func(*args, **(kwargs or {}))


def _wait_for(func, args: Sequence[Any], kwargs: Optional[dict]) -> None:
    owner = getattr(func, "__self__", None)
    attribute = getattr(owner, "__name__", None) if type(owner).__name__ == "getset_descriptor" else None
    if attribute is not None and attribute not in _DATA_ATTRIBUTES:
        return  # metadata (shape, dtype, requires_grad, ...) never waits
    for value in _tensors(args, kwargs):
        for engine in ReadGuard.engines:
            engine.wait_if_pending(value, gradient_only=attribute == "grad")


class suspended:
    """``with suspended():`` the guard does not wait on this thread (our own reads)."""

    def __enter__(self) -> None:
        _local.suspended += 1

    def __exit__(self, *exc) -> None:
        _local.suspended -= 1


def _tensors(args: Sequence[Any], kwargs: Optional[dict]) -> Iterable[torch.Tensor]:
    for value in args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                yield value
