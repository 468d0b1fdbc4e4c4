"""What the training thread, the updater thread and the scheduler's completions share.

An :class:`~bytescheduler.pytorch.overlap.OverlapEngine` runs on three kinds of thread:
the training thread (backward's hooks, ``step()``, the read guard), the updater
(:mod:`~bytescheduler.pytorch.updates`) and the scheduler's completion callbacks. They
share one :class:`Progress`: one lock (``cond``) guarding the steps called, the parameters'
stages, the first error and whether the engine is closed. Waiting on it has a deadline and
notices a failed scheduler.

>>> class Idle:
...     def check(self): pass
...     def end_burst(self): pass
>>> progress = Progress(Idle(), timeout=1.0)
>>> with progress.cond:
...     progress.count_step(), progress.steps_called
(1, 1)
>>> with progress.cond:
...     progress.wait(lambda: progress.steps_called == 1, "the first step")
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from ..core.errors import CommunicationTimeout, ErrorLatch
from ..core.log import logger
from .errors import AGAIN, GradientError
from .params import COMMUNICATED, IDLE, ParamState

_WAIT_SLICE = 0.5  # seconds between checks for errors while waiting


class Progress:
    """The engine's shared state, under one lock.

    Attributes (read or changed with ``cond`` held, except where said):
        cond: the lock, and the condition every state change notifies.
        steps_called: ``step()`` calls so far (an update is due once its step was called).
        latch: the first error of any thread (:class:`~bytescheduler.core.errors.ErrorLatch`).
        closed: the engine was closed; the updater ends.
        busy: parameters not IDLE (read without the lock: the read guard's fast check).

    ``scheduler`` is asked to ``check()`` for its own failure while a wait lasts, and to
    ``end_burst()`` when a wait starts (what the training thread waits for must not sit out
    a merge cycle); ``timeout`` bounds every wait.
    """

    def __init__(self, scheduler: Any, timeout: float) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.steps_called = 0
        self.latch = ErrorLatch()
        self.closed = False
        self.busy = 0
        self.blocked_s = 0.0  # seconds the waits below blocked, in all (the start-up prediction's)
        self.timeout = timeout
        self._scheduler = scheduler

    def count_step(self) -> int:
        """A ``step()`` was called: its updates are due; the number of that step (lock held,
        so that what the step records for its updates is there when they become due)."""
        self.steps_called += 1
        self.cond.notify_all()
        return self.steps_called

    def set_stage(self, state: ParamState, stage: int) -> None:
        """Move a parameter to ``stage`` and keep :attr:`busy` (lock held)."""
        if (state.stage == IDLE) != (stage == IDLE):
            self.busy += 1 if stage != IDLE else -1
        state.stage = stage

    def set_idle(self, state: ParamState) -> None:
        """Nothing is pending for ``state`` any more (lock held)."""
        self.set_stage(state, IDLE)

    def fail(self, error: BaseException) -> None:
        """Keep the first error and wake every waiter (lock held)."""
        if self.latch.set(error):
            logger.error("scheduled optimizer failed: %s", error)
        self.cond.notify_all()

    def close(self) -> None:
        """No more work: every parameter IDLE, the updater ends (lock held)."""
        self.closed = True
        self.cond.notify_all()

    def check_accumulate(self, state: ParamState) -> None:
        """Before autograd accumulates into ``state``'s gradient: refuse it, with a
        :class:`~bytescheduler.pytorch.errors.GradientError` saying why, while something is
        pending for the parameter (its gradient is in flight, or its update is)."""
        with self.cond:
            self.latch.raise_if_set()
            if state.stage == IDLE:
                return
            if state.step_number > self.steps_called:
                raise GradientError(AGAIN.format(state.name))
            raise GradientError(
                f"parameter {state.name!r} got a gradient while its update from the last step was "
                "still pending; it was used without going through a module forward or a torch "
                "operation on this thread (call optimizer.synchronize() before such use)"
            )

    def readable(self, state: ParamState, gradient_only: bool) -> bool:
        """Whether the training thread may read ``state``'s parameter (``gradient_only``: its
        gradient) now (lock held): before its step is called the weights are current, and a
        gradient is readable once averaged; after, once the update is applied."""
        if state.stage == IDLE:
            return True
        if state.step_number > self.steps_called:
            return not gradient_only or state.stage == COMMUNICATED
        return False

    def wait_readable(self, state: ParamState, gradient_only: bool = False) -> None:
        """Block until :meth:`readable`."""
        with self.cond:
            self.wait(lambda: self.readable(state, gradient_only), state.name)

    def wait_all_readable(self, states: Iterable[ParamState]) -> None:
        """Block until every one of ``states`` is :meth:`readable`."""
        with self.cond:
            for state in states:
                if state.stage != IDLE:
                    self.wait(lambda state=state: self.readable(state, False), state.name)

    def wait(self, done: Callable[[], bool], what: str) -> None:
        """Wait (lock held) until ``done()``; raise the first error, or
        :class:`~bytescheduler.core.errors.CommunicationTimeout` naming ``what`` after
        ``timeout`` seconds."""
        if done():
            self.latch.raise_if_set()
            return
        began = time.perf_counter()
        try:
            self._wait(done, what)
        finally:
            self.blocked_s += time.perf_counter() - began

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        # The training thread needs this now (e.g. a gradient read for clipping, or
        # synchronize() before step()): what is queued must not sit out a merge cycle
        # (cycle_ms) waiting for more gradients to come.
        self._scheduler.end_burst()
        while not done():
            self.latch.raise_if_set()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._scheduler.check()
                raise CommunicationTimeout(
                    f"waited {self.timeout} s for {what}; a peer may have died or stopped calling step()"
                )
            self.cond.wait(min(remaining, _WAIT_SLICE))
            if not self.latch:
                try:
                    self._scheduler.check()
                except BaseException as error:  # noqa: BLE001 - every waiter sees it
                    self.fail(error)
        self.latch.raise_if_set()
