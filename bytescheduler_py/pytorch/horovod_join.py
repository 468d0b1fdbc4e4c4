"""``hvd.join()`` with a ScheduledOptimizer open: a rank out of data takes part in the others' steps.

>>> for batch in loader:                 # some ranks have fewer batches          # doctest: +SKIP
...     optimizer.zero_grad(); loss_fn(model(batch)).backward(); optimizer.step()
>>> last = hvd.join()                    # the rank that joined last              # doctest: +SKIP

Horovod's own join leaves a joined rank's background thread to add zeros to every
all-reduce the others still submit. Under a ScheduledOptimizer rank 0 orders every piece,
so a rank inside Horovod's join could neither give that order (rank 0) nor follow it. So
while one is open, ``hvd.join`` is this module's (:class:`JoinGuard`): the rank that calls
it runs *shadow rounds*, one per step the others still take
(:meth:`~bytescheduler.pytorch.overlap.OverlapEngine.shadow_round`: zeros for every
gradient on whichever path the mode switch runs, the averages dropped, nothing updated).
That is what Horovod's join contributes: the others' averages still divide by the whole
world size, and the joined rank's model stays as its last step left it.

Every joining rank also submits one all-reduce of its own, which Horovod completes once
the last rank has submitted it: then every rank has joined. Each rank then tells how many
steps it has taken (its own and its shadow rounds) and runs shadow rounds up to the most
any rank took, so that a round some rank had started is completed everywhere; every rank
has then taken the same number of steps, and training may go on (the next epoch) as if all
had run them. ``hvd.join`` returns the rank that joined last (the one with the most steps
of its own; the highest such rank on a tie), as Horovod's does.

What differs from Horovod's join: the joined rank takes part in the optimizer's
communication only. A Horovod collective of the user's own on the ranks still training (an
``hvd.allreduce`` of a metric each step) finds no partner on the joined rank and waits
without a deadline, as Horovod's do: average such values after ``hvd.join()``. A shadow
round waits for the others with the optimizer's deadline (``timeout``,
``BYTESCHEDULER_TIMEOUT``), as every step does.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Optional

import horovod.torch as hvd
import torch

from ..core.errors import ByteSchedulerError, CommunicationTimeout
from .horovod_hold import Held

_WAIT_SLICE = 0.5  # seconds between checks of the watcher while waiting for the step limit


class JoinUnsupported(ByteSchedulerError):
    """``hvd.join()`` where the ScheduledOptimizers open cannot take part in it (see :class:`JoinGuard`)."""


class ShadowJoin:
    """``hvd.join()`` for one ScheduledOptimizer's engine (see the module docstring).

    ``prefix`` names its Horovod operations (the same on every rank); ``wait_for`` is
    :func:`bytescheduler.pytorch.horovod._wait_for`.
    """

    def __init__(self, engine: Any, prefix: str, timeout: float, wait_for: Callable[..., Any]) -> None:
        # Weakly: the guard's table holds this under the optimizer's backend, which the engine
        # holds; a strong reference would keep an optimizer never closed alive for good.
        self._engine = weakref.ref(engine)
        self._prefix = prefix
        self._timeout = timeout
        self._wait_for = wait_for
        self._joins = 0  # joins so far: every rank joins as often

    @property
    def alive(self) -> bool:
        return self._engine() is not None

    def join(self) -> int:
        # (A model with sparse gradients, whose averages take collectives of their own, is
        # refused when the optimizer is made.)
        engine = self._engine()
        name = f"{self._prefix}.{self._joins}"
        self._joins += 1
        engine.synchronize()  # this rank's last step, with the others
        return _Joining(engine, name, self._timeout, self._wait_for).run()


class _Joining:
    """One ``hvd.join()`` call of :class:`ShadowJoin`: shadow rounds on the calling thread,
    a watcher thread that learns when every rank has joined and how far to go."""

    def __init__(self, engine: Any, name: str, timeout: float, wait_for: Callable[..., Any]) -> None:
        self._engine = engine
        self._name = name
        self._timeout = timeout
        self._wait_for = wait_for
        self._cond = threading.Condition()
        self._taken = engine.steps_taken  # steps, shadow rounds included: the same count on every rank
        self._own = self._taken  # of them, this rank's own
        self._stopping = False  # every rank has joined: no further round starts here unless limited
        self._limit: Optional[int] = None  # the steps every rank takes before leaving
        self._last = -1
        self._error: Optional[BaseException] = None
        self._cancel = threading.Event()

    def run(self) -> int:
        size, rank = hvd.size(), hvd.rank()
        everyone = Held(torch.ones(1, dtype=torch.float64))
        handle = hvd.allreduce_async_(everyone.tensor, name=f"{self._name}.everyone", op=hvd.Sum)
        watcher = threading.Thread(target=self._watch, args=(handle, everyone, size, rank),
                                   name=f"bytescheduler-hvd-join-r{rank}", daemon=True)
        watcher.start()
        try:
            while self._next_round():
                self._engine.shadow_round()
        except BaseException:
            self._cancel.set()
            raise
        finally:
            watcher.join(timeout=self._timeout)
        return self._last

    def _next_round(self) -> bool:
        """Whether to run one more shadow round (counted here), once the limit is known."""
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while self._stopping and self._limit is None and self._error is None:
                if time.monotonic() > deadline:
                    raise CommunicationTimeout(
                        f"rank {hvd.rank()}: hvd.join() waited {self._timeout} s for the ranks' step counts; a peer "
                        "may have died (set BYTESCHEDULER_TIMEOUT to change the limit)")
                self._cond.wait(_WAIT_SLICE)
            if self._error is not None:
                raise self._error
            if self._limit is not None and self._taken >= self._limit:
                return False
            self._taken += 1
            return True

    def _watch(self, handle: int, everyone: Held, size: int, rank: int) -> None:
        """Wait until every rank has joined, then agree on the steps to take and the last joiner."""
        try:
            # No deadline: the others may train for hours yet, as under Horovod's own join.
            if self._wait_for(handle, self._cancel, float("inf"), "hvd.join()", everyone) is False:
                return
            with self._cond:
                self._stopping = True
                taken = self._taken
            counts = torch.zeros(2 * size, dtype=torch.float64)
            counts[rank], counts[size + rank] = taken, self._own
            held = Held(counts)
            result = self._wait_for(hvd.allreduce_async_(held.tensor, name=f"{self._name}.steps", op=hvd.Sum),
                                    self._cancel, self._timeout, "hvd.join()'s step counts", held)
            if result is False:
                return
            steps, own = counts[:size].tolist(), counts[size:].tolist()
            last = max(range(size), key=lambda r: (own[r], r))
            with self._cond:
                self._limit, self._last = int(max(steps)), last
                self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - raised on the joining thread
            with self._cond:
                self._error = error
                self._cond.notify_all()


class JoinGuard:
    """Installs this module's ``hvd.join`` while a ScheduledOptimizer over Horovod is open
    (Horovod's own is back once every one is closed).

    With one open, a join runs its :class:`ShadowJoin`; with more than one (a GAN's two),
    :class:`JoinUnsupported` is raised on the rank that calls it, before it joins.
    """

    def __init__(self, horovods_join: Callable[..., Any]) -> None:
        self._open: "weakref.WeakKeyDictionary[Any, Optional[ShadowJoin]]" = weakref.WeakKeyDictionary()
        self._horovods = horovods_join
        self._installed = False
        self._lock = threading.Lock()

    def opened(self, owner: Any) -> None:
        """A ScheduledOptimizer opened; ``owner`` stands for it (its backend) until :meth:`closed`."""
        with self._lock:
            self._open[owner] = None
            if not self._installed:
                hvd.join, self._installed = self.join, True

    def ready(self, owner: Any, joining: ShadowJoin) -> None:
        """``owner``'s engine is built: a join takes part in its steps."""
        with self._lock:
            if owner in self._open:
                self._open[owner] = joining

    def closed(self, owner: Any) -> None:
        with self._lock:
            self._open.pop(owner, None)
            if not self._open and self._installed:
                hvd.join, self._installed = self._horovods, False

    def join(self, device: int = -1) -> int:
        """``hvd.join`` while a ScheduledOptimizer is open (``device`` is Horovod's, unused
        here: the zeros are the optimizer's own, on its parameters' device)."""
        with self._lock:
            joinings = [joining for joining in self._open.values() if joining is None or joining.alive]
        if not joinings or hvd.size() == 1:
            return self._horovods(device)
        if len(joinings) > 1 or joinings[0] is None:
            raise JoinUnsupported(
                f"rank {hvd.rank()}: hvd.join() with {len(joinings)} bytescheduler ScheduledOptimizers open is not "
                "supported (a joined rank would have to take part in the steps of each, in the others' order): "
                "give every rank the same number of steps (e.g. DistributedSampler(..., drop_last=True)), or "
                "close() all but one before joining")
        return joinings[0].join()
