"""The scheduler runtime: threads, lifecycle and errors around the policy or the follower.

A framework adapter :meth:`~Scheduler.submit`\\ s a :class:`~bytescheduler.core.task.Task`
when a tensor is ready; its future resolves once every piece was communicated. What goes
when is not decided here: on rank 0 (or a rank alone) the
:class:`~bytescheduler.core.policy.SchedulingPolicy` decides, and its decisions are
published on the :class:`~bytescheduler.core.ordering.OrderChannel`; on the other ranks a
:class:`~bytescheduler.core.follower.Follower` replays them. This module only runs them:
a dispatcher thread takes the decided operations and launches them through the
:class:`~bytescheduler.core.backend.Backend`, a receiver thread (followers) reads the
channel, completions release credit and resolve futures, a watchdog turns stuck
operations into errors, and one :class:`State` tells where the scheduler is in its life.

>>> from bytescheduler.core import Scheduler, Task
>>> class Immediate:
...     def launch(self, op, done):
...         done(None)
>>> with Scheduler(Immediate(), partition_bytes=8) as scheduler:
...     future = scheduler.submit(Task(key=0, numel=10, itemsize=4, priority=0, payload=None))
...     future.result(timeout=5).key
0
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Union

from .backend import Backend
from .config import SchedulerConfig
from .errors import CallbackError, CommunicationTimeout, ErrorLatch, SchedulerClosed, as_library_error
from .follower import Follower
from .ledger import Ledger
from .log import configure_logging, logger
from .ordering import OrderChannel, encode_ops, encode_stop
from .policy import SchedulingPolicy
from .receiver import DecisionReceiver
from .task import Operation, Task, TaskFuture
from .timeline import Timeline
from .tuning import AutoTuner

_epochs = itertools.count()
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


class Scheduler:
    """Runs the scheduling policy (rank 0) or replays its decisions (other ranks).

    Args:
        backend: what moves the bytes (see :class:`~bytescheduler.core.backend.Backend`).
        channel: carries rank 0's order to the other ranks; None for a single rank.
        rank: this process's rank, for logs and the timeline.
        config: a :class:`SchedulerConfig`; keyword arguments (``partition_bytes``,
            ``credit_bytes``, ...) override it and the ``BYTESCHEDULER_*`` environment.
        tuning_agree: with ``auto_tune`` and no channel, maps this rank's step time to the
            one every rank uses (for ranks that must partition alike without a channel).
        tuning: further :class:`~bytescheduler.core.tuning.AutoTuner` options, e.g.
            ``{"min_partition_bytes": n}`` for a backend that cannot cut finer.

    Started on construction; :meth:`stop` (or the end of a ``with`` block) ends it, and is
    collective when a channel is used: every rank calls it.
    """

    def __init__(
        self,
        backend: Backend,
        channel: Optional[OrderChannel] = None,
        rank: int = 0,
        config: Optional[SchedulerConfig] = None,
        tuning_agree: Optional[Callable[[float], float]] = None,
        tuning: Optional[Dict[str, Any]] = None,
        **options,
    ) -> None:
        self.config = config = SchedulerConfig.build(config, **options)
        self.rank = rank
        configure_logging(config.log_level, rank)
        self._backend = backend
        self._channel = channel
        self._leader = channel is None or channel.is_leader
        lanes = max(1, int(getattr(backend, "num_lanes", 1)))
        new_epoch = getattr(channel, "new_epoch", None)
        self._epoch = new_epoch() if new_epoch is not None else next(_epochs)

        # Entered as the bare lock (a C call; the condition's own __enter__ is Python), waited
        # on and notified through the condition: once or twice per operation on the hot path.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._state = State.RUNNING
        self._latch = ErrorLatch()
        self._cancel = threading.Event()  # set once work is given up: every thread ends
        self._ledger = Ledger(rank)
        # What decides: the policy on rank 0 (or alone), the replay of its decisions elsewhere.
        self._decider: Union[SchedulingPolicy, Follower]
        if self._leader:
            self._decider = SchedulingPolicy(config.partition_bytes, config.credit_bytes, config.merge,
                                             config.fast_lane_bytes, lanes, config.cycle_ms / 1000.0)
        else:
            self._decider = Follower(rank, lanes, self._ledger)
        self._next_deadline_check = 0.0
        self._sleepers = 0  # threads waiting on _cond
        self._flushers = 0  # of which in flush(), waiting for nothing to be pending
        self._ops_launched = 0
        self._pieces_launched = 0

        self._timeline = Timeline(config.timeline, rank) if config.timeline else None
        # Followers replay rank 0's pieces: only the deciding rank tunes.
        self.tuner: Optional[AutoTuner] = None
        if config.auto_tune and self._leader:
            self.tuner = AutoTuner(config.partition_bytes, config.credit_bytes, self.reconfigure, agree=tuning_agree,
                                   **(tuning or {}))

        role = "alone" if channel is None else ("leader" if self._leader else "follower")
        logger.debug("scheduler epoch %d starts as %s: %s", self._epoch, role, config)
        self._threads = [threading.Thread(target=self._run_dispatch, name=f"bytescheduler-dispatch-r{rank}",
                                          daemon=True)]
        if not self._leader:
            follower = self._decider
            idle = lambda: follower.undecided_elements <= 0 and self._state is State.RUNNING  # noqa: E731
            self._threads.append(DecisionReceiver(channel, self._epoch, follower, self._cond, idle, self._sleep,
                                                  self._cancel, self._fail, f"bytescheduler-receive-r{rank}").thread)
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ public API

    def submit(self, task: Task) -> TaskFuture:
        """Queue ``task`` (its tensor is ready now); its future resolves when it is communicated.
        Raises the scheduler's error if an earlier operation failed."""
        now = time.perf_counter()
        task.ready_time = now
        with self._lock:
            if self._latch or self._state is not State.RUNNING:
                self._raise_if_unusable()
            if task.numel > 0:
                self._ledger.add(task)
                # While the credit is full (most of a backward pass on a slow link) there is
                # nothing to launch, and a wake-up would only cost the busy core a switch.
                if self._decider.add(task, now) and self._sleepers:
                    self._cond.notify_all()
                return task.future
        self._resolve(task)
        return task.future

    def offer(self, task: Task) -> TaskFuture:
        """A follower's stand-in: ``task`` goes if rank 0 schedules its key's next generation
        (it resolves then, as a submitted task does) and is dropped by :meth:`withdraw`
        otherwise. Nothing waits for it meanwhile, and on rank 0 it is simply submitted.
        For a tensor this rank's iteration did not produce (zeros of an unused parameter)
        whose fate only rank 0 knows."""
        if self._leader:
            return self.submit(task)
        task.ready_time = time.perf_counter()
        with self._lock:
            self._raise_if_unusable()
            self._ledger.offer(task)
            self._decider.undecided_elements += task.numel
            self._cond.notify_all()
        return task.future

    def withdraw(self, tasks: Sequence[Task], fence: bool = False) -> None:
        """Drop stand-ins of :meth:`offer` that rank 0 will not schedule; ``fence``: the
        outcome of a provided task (:meth:`provide`) has been applied, so stand-ins may be
        claimed again."""
        with self._lock:
            for task in tasks:
                if self._ledger.standby.pop((task.key, task.generation), None) is not None:
                    self._decider.undecided_elements -= task.numel
            if fence and not self._leader:
                self._decider.fences -= 1
            self._cond.notify_all()

    def provide(self, key: int, provider: Callable[[int], Optional[Task]]) -> None:
        """On a follower, make ``key``'s tasks on demand: when rank 0 schedules generation g,
        ``provider(g)`` (called under the scheduler's lock: it must not block or call back)
        returns the task, or None until it can. Stand-ins are not claimed from then until the
        adapter applied the task's outcome and called ``withdraw(..., fence=True)``. No-op on
        rank 0, which submits such tasks itself."""
        if not self._leader:
            with self._lock:
                self._decider.providers[key] = provider

    def hold(self, iteration: int) -> None:
        """Rank 0 will submit more tasks of ``iteration`` that it cannot submit yet (they
        follow from a collective still in flight): launch nothing of a later iteration until
        :meth:`release`. A follower launches what rank 0 decides: a no-op there."""
        if self._leader:
            with self._lock:
                self._decider.hold(iteration)

    def release(self, iteration: int) -> None:
        """End a :meth:`hold` of ``iteration`` (after submitting what it waited for)."""
        if self._leader:
            with self._lock:
                if self._decider.release(iteration) and self._sleepers:
                    self._cond.notify_all()

    def poke(self) -> None:
        """Something a provider depends on changed: let the dispatcher look again."""
        with self._lock:
            if self._sleepers:
                self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every submitted task has been communicated; raises
        :class:`CommunicationTimeout` after ``timeout`` s (default: the configured one)."""
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._end_burst_locked()
            self._flushers += 1
            try:
                while self._ledger.pending and not self._latch:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CommunicationTimeout(
                            f"rank {self.rank}: {len(self._ledger.pending)} tensor(s) not communicated within "
                            f"{limit} s (e.g. {next(iter(self._ledger.pending.values()))}); is every rank "
                            "submitting the same tensors, and is every peer alive?"
                        )
                    self._sleep(min(remaining, _WATCH_INTERVAL))
            finally:
                self._flushers -= 1
            self._latch.raise_if_set()

    def end_burst(self) -> None:
        """No more tensors are coming soon (e.g. backward ended): what is queued stops waiting
        to be merged (``cycle_ms``). Costs nothing when ``cycle_ms`` is 0."""
        if self._decider.cycle_seconds > 0:
            with self._lock:
                self._end_burst_locked()

    def _end_burst_locked(self) -> None:
        if self._decider.end_burst() and self._sleepers:
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the error of a failed communication operation, if any."""
        self._latch.raise_if_set()

    def set_timeout(self, seconds: float) -> None:
        """Wait at most ``seconds`` for an operation or a peer from now on (e.g. rank 0's
        timeout, learned after start-up by an adapter that agrees on settings late)."""
        with self._lock:
            self.config = self.config.with_options(timeout=seconds)

    @property
    def state(self) -> State:
        return self._state

    @property
    def timeline(self) -> Optional[Timeline]:
        """The Chrome-trace writer when ``timeline`` is configured (toggle its ``recording``)."""
        return self._timeline

    def step_boundary(self) -> None:
        """A training step begins (adapters call it once per step): drives auto-tuning, if on."""
        if self.tuner is not None and not self.tuner.done:
            self.tuner.on_step()

    def reconfigure(self, partition_bytes: Optional[int] = None, credit_bytes: Optional[int] = None) -> None:
        """New partition and credit sizes from now on (queued tensors keep their pieces); only
        rank 0's matter when an order channel is used (the others replay its pieces)."""
        with self._lock:
            self.config = self.config.with_options(partition_bytes=partition_bytes, credit_bytes=credit_bytes)
            self._decider.reconfigure(self.config.partition_bytes, self.config.credit_bytes)
            logger.debug("scheduler epoch %d: partition %d bytes, credit %d bytes", self._epoch,
                         self.config.partition_bytes, self.config.credit_bytes)
            self._cond.notify_all()

    @property
    def abandoned(self) -> bool:
        """True once queued work was given up (``stop(wait=False)`` or a failure)."""
        return self._cancel.is_set()

    @property
    def in_flight_bytes(self) -> int:
        return self._decider.main.in_flight

    @property
    def peak_in_flight_bytes(self) -> int:
        return self._decider.main.peak

    @property
    def stats(self) -> Dict[str, int]:
        fast = self._decider.fast
        return {
            "operations": self._ops_launched,
            "pieces": self._pieces_launched,
            "peak_in_flight_bytes": self._decider.main.peak,
            "peak_fast_lane_bytes": fast.peak if fast is not None else 0,
            "partition_bytes": self.config.partition_bytes,
            "credit_bytes": self.config.credit_bytes,
        }

    def stop(self, wait: bool = True) -> None:
        """Stop the scheduler and join its threads (collective with a channel: every rank calls it).

        ``wait=True`` communicates every submitted task first (the ranks shake hands, so the
        channel can be reused); ``wait=False`` abandons queued work at once (e.g. after an
        exception in the training loop). Raises an operation's error not raised before.
        """
        with self._lock:
            if self._state not in (State.RUNNING, State.FAILED):
                return
            self._state = State.DRAINING if wait and self._state is State.RUNNING else State.ABANDONED
            self._decider.drain()
            if self._state is State.ABANDONED:
                self._cancel.set()
            self._cond.notify_all()
        join_limit = time.monotonic() + (self.config.timeout + 5.0 if wait else 5.0)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, join_limit - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self._fail(CommunicationTimeout(f"rank {self.rank}: scheduler threads {stuck} did not stop in time"))
        with self._lock:
            abandoned = self._ledger.clear()
            self._state = State.STOPPED
        closed = SchedulerClosed(f"rank {self.rank}: the scheduler was stopped before this task was communicated")
        for task in abandoned:
            task.future.set_exception(closed)
        if self._timeline is not None:
            self._timeline.close()
        logger.debug("scheduler epoch %d stopped: %s", self._epoch, self.stats)
        if wait and not self._latch.raised:
            self._latch.raise_if_set()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(wait=exc_type is None)

    # ------------------------------------------------------------------ threads

    def _sleep(self, seconds: float) -> None:
        """Wait on the condition (lock held), counted so that submit can skip the notify."""
        self._sleepers += 1
        try:
            self._cond.wait(seconds)
        finally:
            self._sleepers -= 1

    def _run_dispatch(self) -> None:
        """The dispatcher thread: take what may go now, publish it (rank 0), launch it.

        Only this thread launches: by the time it runs, more gradients are usually ready
        and merge into fewer operations (docs/design.md, "All launches on the dispatcher").
        """
        decider = self._decider
        publish = self._channel.publish if self._leader and self._channel is not None else None
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
                        self._sleep(min(held, _WATCH_INTERVAL) if held > 0 else _WATCH_INTERVAL)
                    self._ledger.launched(ops, now)
                if not ops:
                    if publish is not None:
                        publish(encode_stop(self._epoch))
                    return
                if publish is not None:
                    publish(encode_ops(self._epoch, [
                        (op.lane, [(p.task.key, p.task.generation, p.start, p.stop) for p in op.pieces])
                        for op in ops]))
                self._ops_launched += len(ops)
                self._pieces_launched += sum(len(op.pieces) for op in ops)
                launch, on_done = self._backend.launch, self._on_done
                for op in ops:
                    launch(op, op.on_done(on_done))  # the operation is its own callback
        except BaseException as error:  # noqa: BLE001 - any failure must reach the user
            self._fail(error)

    def _drained(self) -> bool:
        """True once nothing is left to do before the dispatcher ends (lock held)."""
        if self._leader:
            return self._state is State.DRAINING and not self._ledger.pending and not self._ledger.in_flight
        return self._decider.drained()

    # ------------------------------------------------------------------ completion

    def _on_done(self, op: Operation, error: Optional[BaseException]) -> None:
        """A backend finished ``op`` (on the backend's thread); never raises into it."""
        if error is not None:
            self._fail(error)
            return
        with self._lock:
            finished = self._ledger.complete(op)
            if finished is None:
                return  # already failed and cleared
            self._decider.finished(op)
            if self._sleepers and self._completion_wakes(time.perf_counter()):
                self._cond.notify_all()
        timeline = self._timeline
        if timeline is not None and timeline.recording:
            timeline.operation(op, finished, time.perf_counter())
        for task in finished:
            self._resolve(task)

    def _resolve(self, task: Task) -> None:
        callback_error = task.future.set_result(task)
        # The task and its future form a cycle only the garbage collector frees: let go of
        # the payload (a gradient) now, so its memory is reused at once.
        task.payload = None
        if callback_error is not None:
            self._fail(CallbackError(f"rank {self.rank}: a done-callback of {task} raised "
                                     f"{type(callback_error).__name__}: {callback_error}"), callback_error)

    def _completion_wakes(self, now: float) -> bool:
        """Whether a completion changes anything a sleeping thread waits for (lock held).

        A wake-up costs a thread switch and a GIL hand-off on the rank's busy core (~3 per
        operation measured ~0.1 ms of CPU each), so completions wake only when the decider
        says they matter (rank 0: queued work may go), when nothing is pending any more and
        someone waits in ``flush``, or while the scheduler stops.
        """
        if (self._flushers and not self._ledger.pending) or self._state is not State.RUNNING:
            return True
        return self._decider.wake_on_completion(now)

    # ------------------------------------------------------------------ errors

    def _raise_if_unusable(self) -> None:
        self._latch.raise_if_set()
        if self._state is not State.RUNNING:
            raise SchedulerClosed("the scheduler was stopped; create a new one to communicate again")

    def _check_deadlines(self, now: float) -> None:
        """Fail when an operation or a follower's wait has lasted longer than the timeout (lock held)."""
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + _WATCH_INTERVAL
        self._ledger.check_in_flight(now, self.config.timeout)
        if not self._leader:
            self._decider.check_overdue(now, self.config.timeout)

    def _fail(self, error: BaseException, cause: Optional[BaseException] = None) -> None:
        """Record the first error, give up queued work and fail the futures of pending tasks."""
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            if self._latch:
                return
            error = as_library_error(error, self.rank)
            logger.error("scheduler epoch %d failed: %s", self._epoch, error)
            self._latch.set(error)
            if self._state is State.RUNNING:
                self._state = State.FAILED
            elif self._state is State.DRAINING:
                self._state = State.ABANDONED
            self._cancel.set()
            failed = self._ledger.clear()
            self._decider.clear()
            self._cond.notify_all()
        for task in failed:
            task.future.set_exception(error)
