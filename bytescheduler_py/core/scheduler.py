"""The scheduler: a priority queue that partitions, merges and admits pieces under a credit.

A framework adapter submits a :class:`~bytescheduler.core.task.Task` when a tensor is
ready to communicate; the scheduler splits it into pieces, keeps them in a heap ordered
by (priority, arrival), and whenever credit frees launches the best ready pieces through
a :class:`Backend`, fusing small neighbours into one operation. Completion flows back as
the task's future (:class:`~bytescheduler.core.task.TaskFuture`).

With an :class:`~bytescheduler.core.ordering.OrderChannel` the leader's decisions are
replayed by every follower, so all ranks issue collectives in one order.

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

import heapq
import itertools
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

from .config import SchedulerConfig
from .credit import CreditWindow
from .errors import (
    ByteSchedulerError,
    CommunicationError,
    CommunicationTimeout,
    MismatchError,
    SchedulerClosed,
)
from .log import configure_logging, logger
from .ordering import Decision, OrderChannel, decode, encode_ops, encode_stop
from .partition import partition_ranges
from .task import Operation, Piece, Task, TaskFuture
from .timeline import Timeline
from .tuning import AutoTuner

Done = Callable[[Optional[BaseException]], None]

_epochs = itertools.count()
# How often waiting threads wake to check deadlines (seconds).
_WATCH_INTERVAL = 0.5


class Backend(Protocol):
    """Moves the bytes of one operation.

    ``launch`` starts the operation and returns promptly; ``done(None)`` (or
    ``done(exception)``) must be called exactly once when it finished, from any thread,
    possibly before ``launch`` returns. ``num_lanes`` (optional, default 1) is how many
    independent FIFO channels the backend offers; lane 1 carries small operations.
    """

    def launch(self, op: Operation, done: Done) -> None: ...


class Scheduler:
    """Orders, partitions, merges and admits communication under a credit.

    Args:
        backend: what moves the bytes (see :class:`Backend`).
        channel: carries the leader's order to followers; None when the backend does not
            need one order on all ranks (a single rank, Horovod, a parameter server).
        rank: this process's rank, for logs and the timeline.
        config: a :class:`SchedulerConfig`; keyword arguments (``partition_bytes``,
            ``credit_bytes``, ``merge``, ``fast_lane_bytes``, ``timeout``, ``timeline``,
            ``log_level``, ``auto_tune``, ``cycle_ms``) override it and the
            ``BYTESCHEDULER_*`` environment variables.
        tuning_agree: with ``auto_tune`` and no channel, maps this rank's measured step
            time to the value every rank uses (e.g. a broadcast from rank 0), for backends
            whose ranks must partition alike; None when each rank may tune alone.
        tuning: further :class:`~bytescheduler.core.tuning.AutoTuner` options, e.g.
            ``{"min_partition_bytes": n}`` for a backend that cannot cut finer.

    The scheduler is started on construction and stopped by :meth:`stop` (or the end of
    a ``with`` block). ``stop`` is collective when a channel is used: every rank calls it.
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
        if config is None:
            config = SchedulerConfig.resolve(**options)
        elif options:
            config = config.with_options(**options)
        self.config = config
        self.rank = rank
        configure_logging(config.log_level, rank)
        self._backend = backend
        self._channel = channel
        self._leader = channel is None or channel.is_leader
        self._lanes = max(1, int(getattr(backend, "num_lanes", 1)))
        new_epoch = getattr(channel, "new_epoch", None)
        self._epoch = new_epoch() if new_epoch is not None else next(_epochs)

        self._cond = threading.Condition(threading.Lock())
        self._heap: List[Piece] = []
        # Leader: bytes in the heap, when the heap last became non-empty, and whether the
        # adapter said the burst is over (see SchedulerConfig.cycle_ms).
        self._queued_bytes = 0
        self._hold_since = 0.0
        self._hurry = False
        self._credit = CreditWindow(config.credit_bytes)
        self._fast_credit: Optional[CreditWindow] = None
        if self._lanes > 1 and config.fast_lane_bytes > 0:
            self._fast_credit = CreditWindow(config.fast_lane_bytes)
        self._in_flight: Dict[int, Operation] = {}
        self._pending: Dict[Tuple[int, int], Task] = {}
        self._generations: Dict[int, int] = {}
        self._op_ids = itertools.count()
        self._error: Optional[BaseException] = None
        self._error_raised = False
        self._stopping = False
        self._abandon = threading.Event()
        self._closed = False
        self._next_deadline_check = 0.0
        self._sleepers = 0  # threads waiting on _cond
        self._flushers = 0  # of which in flush(), waiting for nothing to be pending
        # Followers only.
        self._decided: Deque[Tuple[float, Decision]] = deque()
        self._undecided_elements = 0
        self._stop_received = False

        self._timeline = Timeline(config.timeline, rank) if config.timeline else None
        # Followers replay the leader's pieces: only the deciding rank tunes.
        self.tuner: Optional[AutoTuner] = None
        if config.auto_tune and self._leader:
            self.tuner = AutoTuner(config.partition_bytes, config.credit_bytes, self.reconfigure, agree=tuning_agree,
                                   **(tuning or {}))
        self._ops_launched = 0
        self._pieces_launched = 0

        role = "alone" if channel is None else ("leader" if self._leader else "follower")
        logger.debug("scheduler epoch %d starts as %s: %s", self._epoch, role, config)
        self._threads = [
            threading.Thread(
                target=self._run_dispatch,
                name=f"bytescheduler-dispatch-r{rank}",
                daemon=True,
            )
        ]
        if not self._leader:
            self._threads.append(
                threading.Thread(target=self._run_receiver, name=f"bytescheduler-receive-r{rank}", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ public API

    def submit(self, task: Task) -> TaskFuture:
        """Queue ``task`` (its tensor is ready now); its future resolves when it is communicated.

        Raises the scheduler's error if an earlier operation failed.
        """
        now = time.perf_counter()
        task.ready_time = now
        finished = False
        with self._cond:
            self._raise_if_unusable()
            if task.numel == 0:
                finished = True
            else:
                generation = self._generations.get(task.key, 0)
                self._generations[task.key] = generation + 1
                task.generation = generation
                self._pending[(task.key, generation)] = task
                if self._leader:
                    was_empty = not self._heap
                    self._push_pieces(task, now)
                    # While the credit is full (most of a backward pass on a slow link) there
                    # is nothing to launch; a completion wakes the dispatcher then. Work held
                    # for merging wakes it once, to time the hold.
                    if self._sleepers and (self._ready_to_take(now) or (was_empty and self._cycle > 0)):
                        self._cond.notify_all()
                else:
                    self._undecided_elements += task.numel
                    if self._sleepers:  # the receiver waits for undecided work
                        self._cond.notify_all()
        if finished:
            task.future.set_result(task)
        return task.future

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every submitted task has been communicated.

        Raises :class:`CommunicationTimeout` after ``timeout`` seconds (default: the
        configured timeout) and the scheduler's error if an operation failed.
        """
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            self._end_burst_locked()
            self._flushers += 1
            try:
                while self._pending and self._error is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CommunicationTimeout(
                            f"rank {self.rank}: {len(self._pending)} tensor(s) not communicated within "
                            f"{limit} s (e.g. {next(iter(self._pending.values()))}); is every rank "
                            "submitting the same tensors, and is every peer alive?"
                        )
                    self._sleep(min(remaining, _WATCH_INTERVAL))
            finally:
                self._flushers -= 1
            self._raise_error()

    def end_burst(self) -> None:
        """Tell the scheduler no more tensors are coming soon (e.g. backward has ended).

        What is queued stops waiting to be merged (``cycle_ms``) and goes out as the credit
        allows; the next tensor submitted after the queue empties starts a new cycle.
        Costs nothing when ``cycle_ms`` is 0.
        """
        if self._cycle > 0:
            with self._cond:
                self._end_burst_locked()

    def _end_burst_locked(self) -> None:
        if self._heap and not self._hurry:
            self._hurry = True
            if self._sleepers:
                self._cond.notify_all()

    @property
    def _cycle(self) -> float:
        return self.config.cycle_ms / 1000.0

    def check(self) -> None:
        """Raise the error of a failed communication operation, if any."""
        with self._cond:
            self._raise_error()

    @property
    def timeline(self) -> Optional[Timeline]:
        """The Chrome-trace writer when ``timeline`` is configured (toggle its ``recording``)."""
        return self._timeline

    def step_boundary(self) -> None:
        """Tell the scheduler a training step begins (adapters call it once per step).

        Drives auto-tuning when it is on; costs nothing otherwise.
        """
        if self.tuner is not None and not self.tuner.done:
            self.tuner.on_step()

    def reconfigure(self, partition_bytes: Optional[int] = None, credit_bytes: Optional[int] = None) -> None:
        """Change the partition and credit sizes from now on (tensors already queued keep their pieces).

        Only the deciding rank's sizes matter when an order channel is used; followers replay
        its pieces.
        """
        with self._cond:
            self.config = self.config.with_options(partition_bytes=partition_bytes, credit_bytes=credit_bytes)
            self._credit.capacity = self.config.credit_bytes
            logger.debug("scheduler epoch %d: partition %d bytes, credit %d bytes", self._epoch,
                         self.config.partition_bytes, self.config.credit_bytes)
            self._cond.notify_all()

    @property
    def abandoned(self) -> bool:
        """True once queued work was given up (``stop(wait=False)`` or a failure)."""
        return self._abandon.is_set()

    @property
    def in_flight_bytes(self) -> int:
        return self._credit.in_flight

    @property
    def peak_in_flight_bytes(self) -> int:
        return self._credit.peak

    @property
    def stats(self) -> Dict[str, int]:
        return {
            "operations": self._ops_launched,
            "pieces": self._pieces_launched,
            "peak_in_flight_bytes": self._credit.peak,
            "peak_fast_lane_bytes": self._fast_credit.peak if self._fast_credit is not None else 0,
            "partition_bytes": self.config.partition_bytes,
            "credit_bytes": self.config.credit_bytes,
        }

    def stop(self, wait: bool = True) -> None:
        """Stop the scheduler and join its threads.

        With ``wait=True`` every submitted task is communicated first and, when an order
        channel is used, the ranks shake hands so the channel can be reused; every rank
        must then call ``stop``. ``wait=False`` abandons queued work at once (e.g. after
        an exception in the training loop). Raises the scheduler's error if an operation
        failed and the error was not raised before.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            if not wait:
                self._abandon.set()
            self._cond.notify_all()
        join_limit = time.monotonic() + (self.config.timeout + 5.0 if wait else 5.0)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, join_limit - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self._abandon.set()
            self._fail(CommunicationTimeout(f"rank {self.rank}: scheduler threads {stuck} did not stop in time"))
        with self._cond:
            abandoned = list(self._pending.values())
            self._pending.clear()
            self._in_flight.clear()  # late completions of abandoned work are ignored
        closed = SchedulerClosed(f"rank {self.rank}: the scheduler was stopped before this task was communicated")
        for task in abandoned:
            task.future.set_exception(closed)
        if self._timeline is not None:
            self._timeline.close()
        if (not wait or self._error is not None) and hasattr(self._channel, "broken"):
            # Abandoned or failed: operations posted on one rank only may remain on its groups.
            self._channel.broken = True
        logger.debug("scheduler epoch %d stopped: %s", self._epoch, self.stats)
        if wait and not self._error_raised:
            with self._cond:
                self._raise_error()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(wait=exc_type is None)

    def _sleep(self, seconds: float) -> None:
        """Wait on the condition (lock held), counted so that submit can skip the notify."""
        self._sleepers += 1
        try:
            self._cond.wait(seconds)
        finally:
            self._sleepers -= 1

    # ------------------------------------------------------------------ errors

    def _raise_if_unusable(self) -> None:
        self._raise_error()
        if self._stopping:
            raise SchedulerClosed("the scheduler was stopped; create a new one to communicate again")

    def _raise_error(self) -> None:
        if self._error is not None:
            self._error_raised = True
            error = self._error
            raise type(error)(str(error)) from error

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            failed = self._fail_locked(error)
            error = self._error
        for task in failed:
            if not task.future.done():
                task.future.set_exception(error)

    def _fail_locked(self, error: BaseException) -> List[Task]:
        """Record the first error, drop queued work; return the tasks whose futures must fail."""
        if self._error is not None:
            return []
        if not isinstance(error, ByteSchedulerError):
            wrapped = CommunicationError(
                f"rank {self.rank}: communication failed ({type(error).__name__}: {error}); a peer "
                "process may have died or the network failed"
            )
            wrapped.__cause__ = error
            error = wrapped
        logger.error("scheduler epoch %d failed: %s", self._epoch, error)
        self._error = error
        self._abandon.set()
        failed = list(self._pending.values())
        self._pending.clear()
        self._heap.clear()
        self._queued_bytes = 0
        self._in_flight.clear()  # late completions of these are ignored
        self._decided.clear()
        self._cond.notify_all()
        return failed

    def _check_deadlines(self, now: float) -> None:
        """Fail when an operation or a follower's wait has lasted longer than the timeout."""
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + _WATCH_INTERVAL
        limit = self.config.timeout
        for op in self._in_flight.values():
            if now - op.launch_time > limit:
                raise CommunicationTimeout(
                    f"rank {self.rank}: {op} did not finish within {limit} s; a peer may have died or "
                    "stopped submitting (set BYTESCHEDULER_TIMEOUT to change the limit)"
                )
        if not self._leader:
            if self._decided and now - self._decided[0][0] > limit:
                lane, pieces = self._decided[0][1]
                missing = [p[:2] for p in pieces if (p[0], p[1]) not in self._pending]
                raise MismatchError(
                    f"rank {self.rank}: rank 0 scheduled tensor(s) (key, generation) {missing} that this "
                    f"rank has not submitted within {limit} s; every rank must submit the same tensors"
                )
            oldest = min((t.ready_time for t in self._pending.values()), default=now)
            if now - oldest > limit:
                raise CommunicationTimeout(
                    f"rank {self.rank}: rank 0 has not scheduled tensors this rank submitted "
                    f"{now - oldest:.0f} s ago; has rank 0 died or stopped submitting?"
                )

    # ------------------------------------------------------------------ leader

    def _push_pieces(self, task: Task, now: float) -> None:
        if not self._heap:
            self._hold_since = now
        for start, stop in partition_ranges(task.numel, task.itemsize, self.config.partition_bytes):
            piece = Piece(task, start, stop)
            piece.queued_time = now
            heapq.heappush(self._heap, piece)
        self._queued_bytes += task.nbytes

    def _hold_remaining(self, now: float) -> float:
        """Seconds the queued work may still wait for more to merge with; 0 when it must go (lock held).

        Work is held while less than one operation's worth (``partition_bytes``) is queued,
        for at most ``cycle_ms`` after the queue became non-empty, unless the burst ended
        or the scheduler is stopping. Without ``merge`` (Horovod fuses by itself) nothing
        would come of holding, so nothing is held.
        """
        cycle = self._cycle
        if cycle <= 0 or not self.config.merge or self._hurry or self._stopping:
            return 0.0
        if self._queued_bytes >= self.config.partition_bytes:
            return 0.0
        return max(0.0, self._hold_since + cycle - now)

    def _window(self, piece: Piece) -> Tuple[CreditWindow, int, int]:
        """The credit window, lane and merge limit for an operation starting with ``piece``.

        Small operations take the fast lane. A larger piece takes it too when the fast lane
        is idle and every operation in flight on the main lane is less urgent: in the
        backend's first-in-first-out queue it would otherwise wait for all of them (e.g. a
        first layer's gradient of a few MiB behind the last layers' pieces).
        """
        fast = self._fast_credit
        if fast is not None:
            if piece.nbytes <= self.config.fast_lane_bytes:
                return fast, 1, self.config.fast_lane_bytes
            if fast.in_flight == 0 and self._credit.in_flight > 0 and piece.task.priority < min(
                (op.pieces[0].task.priority for op in self._in_flight.values() if op.lane == 0),
                default=float("-inf"),
            ):
                return fast, 1, piece.nbytes
        return self._credit, 0, self.config.partition_bytes

    def _ready_to_take(self, now: float) -> bool:
        """True when the most urgent queued piece may go now and fits its credit (leader, lock held)."""
        if not self._heap or self._hold_remaining(now) > 0:
            return False
        window, _, _ = self._window(self._heap[0])
        return window.admits(self._heap[0].nbytes)

    def _take_ops(self) -> List[Operation]:
        """Pop what the credit admits now, highest priority first, fusing small neighbours.

        Small operations go to the fast lane and count against its own window, so an urgent
        small tensor (the first layers', ready last in backward) never waits for the large
        pieces that fill the main credit; large ones count against ``credit_bytes``, except
        an urgent one that finds the fast lane idle (see :meth:`_window`).
        """
        heap = self._heap
        merge = self.config.merge
        ops: List[Operation] = []
        if heap and self._hold_remaining(time.perf_counter()) > 0:
            return ops
        while heap:
            window, lane, limit = self._window(heap[0])
            if not window.admits(heap[0].nbytes):
                break
            first = heapq.heappop(heap)
            pieces = [first]
            total = first.nbytes
            fuse_key = first.task.fuse_key
            if merge and fuse_key is not None:
                while heap:
                    candidate = heap[0]
                    size = total + candidate.nbytes
                    if (
                        candidate.task.fuse_key != fuse_key
                        or size > limit
                        or window.in_flight + size > window.capacity
                    ):
                        break
                    pieces.append(heapq.heappop(heap))
                    total = size
            window.take(total)
            self._queued_bytes -= total
            op = Operation(pieces, lane, next(self._op_ids))
            op.launch_time = time.perf_counter()  # in flight from now on (deadline check)
            self._in_flight[op.op_id] = op
            ops.append(op)
        if not heap:
            self._hurry = False  # the next tensor starts a new cycle
        return ops

    def _lane_window(self, lane: int) -> CreditWindow:
        return self._fast_credit if lane == 1 and self._fast_credit is not None else self._credit

    def _run_dispatch(self) -> None:
        """The dispatcher thread: take what may go now, publish it (leader), launch it.

        Every operation is launched here, also when the thread that made it ready could
        have: by the time the dispatcher runs, more gradients are usually ready and are
        merged into fewer operations (launching from the submitting thread measured 8-10%
        slower on loopback, see docs/benchmarks.md).
        """
        take = self._take_ops if self._leader else self._take_decided
        try:
            while True:
                with self._cond:
                    while True:
                        if self._abandon.is_set():
                            return
                        now = time.perf_counter()
                        ops = take()
                        if ops or self._drained():
                            break
                        self._check_deadlines(now)
                        held = self._hold_remaining(now) if self._leader and self._heap else 0.0
                        self._sleep(min(held, _WATCH_INTERVAL) if held > 0 else _WATCH_INTERVAL)
                if not ops:
                    if self._leader and self._channel is not None:
                        self._channel.publish(encode_stop(self._epoch))
                    return
                self._publish_and_launch(ops, now)
        except BaseException as error:  # noqa: BLE001 - any failure must reach the user
            self._fail(error)

    def _publish_and_launch(self, ops: List[Operation], now: float) -> None:
        """Publish the leader's decisions, then launch the operations."""
        if self._leader and self._channel is not None:
            decisions = [
                (op.lane, [(p.task.key, p.task.generation, p.start, p.stop) for p in op.pieces])
                for op in ops
            ]
            self._channel.publish(encode_ops(self._epoch, decisions))
        self._launch(ops, now)

    def _drained(self) -> bool:
        """True once stopping and nothing is left to do (lock held)."""
        if self._leader:
            return self._stopping and not self._pending and not self._in_flight
        if self._stop_received and not self._decided and not self._in_flight:
            if self._pending:
                raise MismatchError(
                    f"rank {self.rank}: rank 0 stopped while this rank still had "
                    f"{len(self._pending)} tensor(s) to communicate; every rank "
                    "must submit the same tensors"
                )
            return True
        return False

    def _launch(self, ops: List[Operation], now: float) -> None:
        for op in ops:
            op.launch_time = now
            self._ops_launched += 1
            self._pieces_launched += len(op.pieces)
            self._backend.launch(op, lambda error, op=op: self._on_done(op, error))

    def _on_done(self, op: Operation, error: Optional[BaseException]) -> None:
        if error is not None:
            self._fail(error)
            return
        now = time.perf_counter()
        finished: List[Task] = []
        with self._cond:
            if self._in_flight.pop(op.op_id, None) is None:
                return  # already failed and cleared
            self._lane_window(op.lane).release(op.nbytes)
            for piece in op.pieces:
                task = piece.task
                task.remaining -= piece.stop - piece.start
                if task.remaining == 0 and self._pending.pop((task.key, task.generation), None):
                    finished.append(task)
            if self._sleepers and self._completion_wakes(now):
                self._cond.notify_all()
        if self._timeline is not None and self._timeline.recording:
            self._record(op, finished, now)
        for task in finished:
            task.future.set_result(task)
            # A task and its future refer to each other (the result is the task), a cycle
            # only the garbage collector frees, at random times. Let go of the payload (a
            # gradient, an adapter's job) once the callbacks have run, so its memory is
            # reused at once instead of being faulted in afresh by the next backward.
            task.payload = None

    def _completion_wakes(self, now: float) -> bool:
        """Whether a completion changes anything a sleeping thread waits for (lock held).

        A wake-up costs a thread switch and a GIL hand-off on the rank's busy core (~3 per
        operation measured ~0.1 ms of CPU each), so completions wake only when they let the
        leader take queued work, when nothing is pending any more and someone waits in
        ``flush``, or while a scheduler stops (draining). A follower's dispatcher waits for
        decisions and its own tensors, never for completions.
        """
        if (self._flushers and not self._pending) or self._stopping or self._stop_received:
            return True
        return self._leader and self._ready_to_take(now)

    def _record(self, op: Operation, finished: List[Task], now: float) -> None:
        timeline = self._timeline
        names = "+".join(p.task.name for p in op.pieces)
        for piece in op.pieces:
            timeline.span("queue", piece.task.name, piece.queued_time, op.launch_time,
                          {"start": piece.start, "stop": piece.stop})
        timeline.span(f"lane{op.lane}", names, op.launch_time, now,
                      {"bytes": op.nbytes, "pieces": len(op.pieces)})
        for task in finished:
            timeline.span("task", task.name, task.ready_time, now,
                          {"key": task.key, "generation": task.generation, "bytes": task.nbytes,
                           "priority": task.priority})

    # ------------------------------------------------------------------ follower

    def _run_receiver(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._undecided_elements <= 0 and not self._stopping:
                        if self._abandon.is_set():
                            return
                        self._sleep(_WATCH_INTERVAL)
                    if self._abandon.is_set():
                        return
                message = self._channel.receive(self._abandon)
                if message is None:
                    return
                decisions = decode(message, self._epoch)
                now = time.perf_counter()
                with self._cond:
                    if decisions is None:
                        self._stop_received = True
                        self._cond.notify_all()
                        return
                    for decision in decisions:
                        self._decided.append((now, decision))
                        for _, _, start, stop in decision[1]:
                            self._undecided_elements -= stop - start
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001
            self._fail(error)

    def _take_decided(self) -> List[Operation]:
        """Turn decided operations whose tensors are ready here into operations, in order."""
        ops: List[Operation] = []
        while self._decided:
            _, (lane, spec) = self._decided[0]
            pieces = []
            for key, generation, start, stop in spec:
                task = self._pending.get((key, generation))
                if task is None:
                    if generation < self._generations.get(key, 0):
                        raise MismatchError(
                            f"rank {self.rank}: rank 0 scheduled tensor key {key} generation {generation} "
                            "again after it completed; ranks disagree on the tensors"
                        )
                    return ops
                if stop > task.numel:
                    raise MismatchError(
                        f"rank {self.rank}: rank 0 has {stop}+ elements in tensor {task.name} (key {key}) "
                        f"but this rank has {task.numel}; every rank must communicate tensors of the "
                        "same shape"
                    )
                piece = Piece(task, start, stop)
                piece.queued_time = task.ready_time
                pieces.append(piece)
            self._decided.popleft()
            op = Operation(pieces, min(lane, self._lanes - 1), next(self._op_ids))
            op.launch_time = time.perf_counter()
            self._in_flight[op.op_id] = op
            self._lane_window(op.lane).take(op.nbytes)
            ops.append(op)
        return ops
