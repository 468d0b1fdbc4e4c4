"""The scheduler: what a framework adapter calls to have its tensors communicated.

A framework adapter :meth:`~Scheduler.submit`\\ s a :class:`~bytescheduler.core.task.Task`
when a tensor is ready; its future resolves once every piece was communicated. What goes
when is not decided here: on rank 0 (or a rank alone) the
:class:`~bytescheduler.core.policy.SchedulingPolicy` decides, and its decisions are
published on the :class:`~bytescheduler.core.ordering.OrderChannel`; on the other ranks a
:class:`~bytescheduler.core.follower.Follower` replays them. Nor are they run here: the
:class:`~bytescheduler.core.runtime.Runtime` does (a dispatcher thread launches the decided
operations through the :class:`~bytescheduler.core.backend.Backend`, completions release
credit and resolve futures, a watchdog turns stuck operations into errors), and its
:class:`State` tells where the scheduler is in its life.

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

import itertools
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Union

from .backend import Backend
from .config import SchedulerConfig
from .follower import Follower
from .ledger import Ledger
from .log import configure_logging, logger
from .ordering import OrderChannel
from .policy import SchedulingPolicy
from .runtime import Runtime, State
from .task import Task, TaskFuture
from .timeline import Timeline
from .tuning import AutoTuner

_epochs = itertools.count()


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
        self._channel = channel
        self._leader = channel is None or channel.is_leader
        lanes = max(1, int(getattr(backend, "num_lanes", 1)))
        new_epoch = getattr(channel, "new_epoch", None)
        self._epoch = new_epoch() if new_epoch is not None else next(_epochs)

        # Entered as the bare lock (a C call; the condition's own __enter__ is Python), waited
        # on and notified through the condition: once or twice per operation on the hot path.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ledger = Ledger(rank)
        # What decides: the policy on rank 0 (or alone), the replay of its decisions elsewhere.
        self._decider: Union[SchedulingPolicy, Follower]
        if self._leader:
            self._decider = SchedulingPolicy(config.partition_bytes, config.credit_bytes, config.merge,
                                             config.fast_lane_bytes, lanes, config.cycle_ms / 1000.0)
        else:
            self._decider = Follower(rank, lanes, self._ledger)
        self._timeline = Timeline(config.timeline, rank) if config.timeline else None
        self._runtime = Runtime(backend, channel, self._leader, self._decider, self._ledger, self._lock, self._cond,
                                self._epoch, rank, self._timeline, lambda: self.config.timeout)
        # Followers replay rank 0's pieces: only the deciding rank tunes.
        self.tuner: Optional[AutoTuner] = None
        if config.auto_tune and self._leader:
            self.tuner = AutoTuner(config.partition_bytes, config.credit_bytes, self.reconfigure, agree=tuning_agree,
                                   **(tuning or {}))

        role = "alone" if channel is None else ("leader" if self._leader else "follower")
        logger.debug("scheduler epoch %d starts as %s: %s", self._epoch, role, config)
        self._runtime.start()

    # ------------------------------------------------------------------ public API

    def submit(self, task: Task) -> TaskFuture:
        """Queue ``task`` (its tensor is ready now); its future resolves when it is communicated.
        Raises the scheduler's error if an earlier operation failed."""
        now = time.perf_counter()
        task.ready_time = now
        runtime = self._runtime
        with self._lock:
            if runtime.latch or runtime.state is not State.RUNNING:
                runtime.raise_if_unusable()
            if task.numel > 0:
                self._ledger.add(task)
                # While the credit is full (most of a backward pass on a slow link) there is
                # nothing to launch, and a wake-up would only cost the busy core a switch.
                if self._decider.add(task, now) and runtime.sleepers:
                    self._cond.notify_all()
                return task.future
        runtime.resolve(task)
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
            self._runtime.raise_if_unusable()
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
                if self._decider.release(iteration) and self._runtime.sleepers:
                    self._cond.notify_all()

    def poke(self) -> None:
        """Something a provider depends on changed: let the dispatcher look again."""
        with self._lock:
            if self._runtime.sleepers:
                self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every submitted task has been communicated; raises
        :class:`CommunicationTimeout` after ``timeout`` s (default: the configured one)."""
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._end_burst_locked()
            self._runtime.wait_communicated(deadline, limit)
            self._runtime.latch.raise_if_set()

    def end_burst(self) -> None:
        """No more tensors are coming soon (e.g. backward ended): what is queued stops waiting
        to be merged (``cycle_ms``). Costs nothing when ``cycle_ms`` is 0."""
        if self._decider.cycle_seconds > 0:
            with self._lock:
                self._end_burst_locked()

    def _end_burst_locked(self) -> None:
        if self._decider.end_burst() and self._runtime.sleepers:
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the error of a failed communication operation, if any."""
        self._runtime.latch.raise_if_set()

    def set_timeout(self, seconds: float) -> None:
        """Wait at most ``seconds`` for an operation or a peer from now on (e.g. rank 0's
        timeout, learned after start-up by an adapter that agrees on settings late)."""
        with self._lock:
            self.config = self.config.with_options(timeout=seconds)

    @property
    def state(self) -> State:
        return self._runtime.state

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
        return self._runtime.abandoned

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
            "operations": self._runtime.ops_launched,
            "pieces": self._runtime.pieces_launched,
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
        if not self._runtime.stop(wait):
            return
        if self._timeline is not None:
            self._timeline.close()
        logger.debug("scheduler epoch %d stopped: %s", self._epoch, self.stats)
        latch = self._runtime.latch
        if wait and not latch.raised:
            latch.raise_if_set()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(wait=exc_type is None)
