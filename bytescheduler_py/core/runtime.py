"""The scheduler's runtime: its threads, their life, and the error that ends them.

A dispatcher thread takes the operations the decider lets go (the
:class:`~bytescheduler.core.policy.SchedulingPolicy` on rank 0, a
:class:`~bytescheduler.core.follower.Follower` elsewhere), publishes them on rank 0 and
launches them through the :class:`~bytescheduler.core.backend.Backend`; a follower's
:class:`~bytescheduler.core.receiver.DecisionReceiver` thread reads rank 0's decisions;
completions release credit and resolve futures; a watchdog on the idle dispatcher turns
stuck operations into errors. One :class:`State` tells where the scheduler is in its
life, and an :class:`~bytescheduler.core.errors.ErrorLatch` keeps the first error. The
:class:`~bytescheduler.core.scheduler.Scheduler` that owns a :class:`Runtime` feeds the
decider and the ledger under the same lock.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Callable, Optional, Union

from .backend import Backend
from .errors import CallbackError, CommunicationTimeout, ErrorLatch, SchedulerClosed, as_library_error
from .follower import Follower
from .ledger import Ledger
from .log import logger
from .ordering import OrderChannel, encode_ops, encode_stop
from .policy import SchedulingPolicy
from .receiver import DecisionReceiver
from .task import Operation, Task
from .timeline import Timeline

# How often waiting threads wake to check deadlines (seconds).
_WATCH_INTERVAL = 0.5
# Operations decided, published and launched at a time: a large credit admits thousands of
# pieces at once, and objects that live that long cost the garbage collector more than
# they cost to make; a smaller batch also lets a tensor that comes in meanwhile go first.
_BATCH = 1024


class State(enum.Enum):
    """Where a scheduler is in its life (one value at a time, guarded by its lock)."""

    RUNNING = "running"  # accepts tasks
    DRAINING = "draining"  # stop(wait=True): communicates what was submitted, then ends
    FAILED = "failed"  # an operation failed; threads end; stop() still has to be called
    ABANDONED = "abandoned"  # stop(wait=False), or a failure while draining: work is given up
    STOPPED = "stopped"  # stop() returned: threads joined, futures resolved


class Runtime:
    """Runs a scheduler's threads and completions, from start to stop or the first error.

    Args:
        backend: launches the operations (only the dispatcher thread calls it).
        channel: rank 0's order (published to on rank 0, read from elsewhere); None alone.
        leader: whether this rank decides (rank 0, or a rank alone).
        decider: the policy (leader) or the follower.
        ledger: the tasks submitted and the operations in flight.
        lock, cond: the owner's lock and its condition, which guard the decider, the ledger
            and this object (the hot path enters the bare lock, and waits on and notifies
            through the condition).
        epoch, rank: the scheduler's epoch (messages, logs) and this process's rank.
        timeline: records each completed operation while recording; None without one.
        timeout: the limit, in seconds, for an operation or a peer; asked each time, as the
            owner may change it.

    The owner reads :attr:`state`, :attr:`latch` and :attr:`sleepers` (changed under the
    lock) and the launch counts (written by the dispatcher thread only); it calls
    :meth:`start` once, and :meth:`stop`.
    """

    def __init__(
        self,
        backend: Backend,
        channel: Optional[OrderChannel],
        leader: bool,
        decider: Union[SchedulingPolicy, Follower],
        ledger: Ledger,
        lock: threading.Lock,
        cond: threading.Condition,
        epoch: int,
        rank: int,
        timeline: Optional[Timeline],
        timeout: Callable[[], float],
    ) -> None:
        self._backend = backend
        self._publish = channel.publish if leader and channel is not None else None
        self._leader = leader
        self._decider = decider
        self._ledger = ledger
        self._lock = lock
        self._cond = cond
        self._epoch = epoch
        self._rank = rank
        self._timeline = timeline
        self._timeout = timeout
        self.state = State.RUNNING
        self.latch = ErrorLatch()
        self._cancel = threading.Event()  # set once work is given up: every thread ends
        self.sleepers = 0  # threads waiting on the condition
        self._flushers = 0  # of which in wait_communicated, waiting for nothing to be pending
        self._next_deadline_check = 0.0
        self.ops_launched = 0
        self.pieces_launched = 0
        self._threads = [threading.Thread(target=self._run_dispatch, name=f"bytescheduler-dispatch-r{rank}",
                                          daemon=True)]
        if not leader:
            follower = decider
            idle = lambda: follower.undecided_elements <= 0 and self.state is State.RUNNING  # noqa: E731
            self._threads.append(DecisionReceiver(channel, epoch, follower, cond, idle, self.sleep, self._cancel,
                                                  self.fail, f"bytescheduler-receive-r{rank}").thread)

    def start(self) -> None:
        """Start the threads (once)."""
        for thread in self._threads:
            thread.start()

    @property
    def abandoned(self) -> bool:
        """True once queued work was given up (a stop without waiting, or a failure)."""
        return self._cancel.is_set()

    def raise_if_unusable(self) -> None:
        """Raise the first error, or :class:`SchedulerClosed` once stopping (lock held)."""
        self.latch.raise_if_set()
        if self.state is not State.RUNNING:
            raise SchedulerClosed("the scheduler was stopped; create a new one to communicate again")

    def sleep(self, seconds: float) -> None:
        """Wait on the condition (lock held), counted so that submit can skip the notify."""
        self.sleepers += 1
        try:
            self._cond.wait(seconds)
        finally:
            self.sleepers -= 1

    def wait_communicated(self, deadline: float, limit: float) -> None:
        """Wait (lock held) until no task is pending or an operation failed; raises
        :class:`CommunicationTimeout` at ``deadline`` (``time.monotonic()``), ``limit`` s
        after the wait began."""
        self._flushers += 1
        try:
            while self._ledger.pending and not self.latch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommunicationTimeout(
                        f"rank {self._rank}: {len(self._ledger.pending)} tensor(s) not communicated within "
                        f"{limit} s (e.g. {next(iter(self._ledger.pending.values()))}); is every rank "
                        "submitting the same tensors, and is every peer alive?"
                    )
                self.sleep(min(remaining, _WATCH_INTERVAL))
        finally:
            self._flushers -= 1

    def stop(self, wait: bool) -> bool:
        """End the threads and join them: with ``wait`` once every submitted task was
        communicated, otherwise at once (queued work is given up). Fails the futures of the
        tasks left; False, doing nothing, when already stopping or stopped."""
        with self._lock:
            if self.state not in (State.RUNNING, State.FAILED):
                return False
            self.state = State.DRAINING if wait and self.state is State.RUNNING else State.ABANDONED
            self._decider.drain()
            if self.state is State.ABANDONED:
                self._cancel.set()
            self._cond.notify_all()
        join_limit = time.monotonic() + (self._timeout() + 5.0 if wait else 5.0)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, join_limit - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self.fail(CommunicationTimeout(f"rank {self._rank}: scheduler threads {stuck} did not stop in time"))
        with self._lock:
            abandoned = self._ledger.clear()
            self.state = State.STOPPED
        closed = SchedulerClosed(f"rank {self._rank}: the scheduler was stopped before this task was communicated")
        for task in abandoned:
            task.future.set_exception(closed)
        return True

    # ------------------------------------------------------------------ the dispatcher thread

    def _run_dispatch(self) -> None:
        """The dispatcher thread: take what may go now, publish it (rank 0), launch it.

        Only this thread launches: by the time it runs, more gradients are usually ready
        and merge into fewer operations (docs/design.md, "All launches on the dispatcher").
        """
        decider = self._decider
        publish = self._publish
        try:
            while True:
                with self._lock:
                    while True:
                        if self._cancel.is_set():
                            return
                        now = time.perf_counter()
                        ops = decider.decide(now, _BATCH)
                        if ops or self._drained():
                            break
                        self._check_deadlines(now)
                        held = decider.hold_remaining(now)
                        self.sleep(min(held, _WATCH_INTERVAL) if held > 0 else _WATCH_INTERVAL)
                    self._ledger.launched(ops, now)
                if not ops:
                    if publish is not None:
                        publish(encode_stop(self._epoch))
                    return
                if publish is not None:
                    publish(encode_ops(self._epoch, [
                        (op.lane, [(p.task.key, p.task.generation, p.start, p.stop) for p in op.pieces])
                        for op in ops]))
                self.ops_launched += len(ops)
                self.pieces_launched += sum(len(op.pieces) for op in ops)
                launch, on_done = self._backend.launch, self._on_done
                for op in ops:
                    launch(op, op.on_done(on_done))  # the operation is its own callback
        except BaseException as error:  # noqa: BLE001 - any failure must reach the user
            self.fail(error)

    def _drained(self) -> bool:
        """True once nothing is left to do before the dispatcher ends (lock held)."""
        if self._leader:
            return self.state is State.DRAINING and not self._ledger.pending and not self._ledger.in_flight
        return self._decider.drained()

    def _check_deadlines(self, now: float) -> None:
        """Fail when an operation or a follower's wait has lasted longer than the timeout (lock held)."""
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + _WATCH_INTERVAL
        limit = self._timeout()
        self._ledger.check_in_flight(now, limit)
        if not self._leader:
            self._decider.check_overdue(now, limit)

    # ------------------------------------------------------------------ completion

    def _on_done(self, op: Operation, error: Optional[BaseException]) -> None:
        """A backend finished ``op`` (on the backend's thread); never raises into it."""
        if error is not None:
            self.fail(error)
            return
        with self._lock:
            finished = self._ledger.complete(op)
            if finished is None:
                return  # already failed and cleared
            self._decider.finished(op)
            if self.sleepers and self._completion_wakes(time.perf_counter()):
                self._cond.notify_all()
        timeline = self._timeline
        if timeline is not None and timeline.recording:
            timeline.operation(op, finished, time.perf_counter())
        for task in finished:
            self.resolve(task)

    def resolve(self, task: Task) -> None:
        """``task`` was communicated: resolve its future (a callback's error fails the scheduler)."""
        callback_error = task.future.set_result(task)
        # The task and its future form a cycle only the garbage collector frees: let go of
        # the payload (a gradient) now, so its memory is reused at once.
        task.payload = None
        if callback_error is not None:
            self.fail(CallbackError(f"rank {self._rank}: a done-callback of {task} raised "
                                    f"{type(callback_error).__name__}: {callback_error}"), callback_error)

    def _completion_wakes(self, now: float) -> bool:
        """Whether a completion changes anything a sleeping thread waits for (lock held).

        A wake-up costs a thread switch and a GIL hand-off on the rank's busy core (a few per
        operation, each a noticeable share of its CPU), so completions wake only when the decider
        says they matter (rank 0: queued work may go), when nothing is pending any more and
        someone waits in ``flush``, or while the scheduler stops.
        """
        if (self._flushers and not self._ledger.pending) or self.state is not State.RUNNING:
            return True
        return self._decider.wake_on_completion(now)

    # ------------------------------------------------------------------ errors

    def fail(self, error: BaseException, cause: Optional[BaseException] = None) -> None:
        """Record the first error, give up queued work and fail the futures of pending tasks."""
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            if self.latch:
                return
            error = as_library_error(error, self._rank)
            logger.error("scheduler epoch %d failed: %s", self._epoch, error)
            self.latch.set(error)
            if self.state is State.RUNNING:
                self.state = State.FAILED
            elif self.state is State.DRAINING:
                self.state = State.ABANDONED
            self._cancel.set()
            failed = self._ledger.clear()
            self._decider.clear()
            self._cond.notify_all()
        for task in failed:
            task.future.set_exception(error)
