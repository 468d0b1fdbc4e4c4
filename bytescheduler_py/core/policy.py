"""The scheduling policy: what rank 0 decides, as a pure object.

:class:`SchedulingPolicy` owns no thread, socket, lock or clock. It is fed events (a task
became ready, an operation finished, the burst ended) with the time passed in, and it
answers :meth:`~SchedulingPolicy.decide` with the operations to launch now: pieces of at
most ``partition_bytes``, most urgent first (priority, then arrival), small neighbours of
one fuse key merged, admitted under the credit, small or urgent ones on the fast lane.
Tasks of an earlier training iteration (:attr:`Task.iteration
<bytescheduler.core.task.Task.iteration>`) go before any of a later one, and a
:meth:`~SchedulingPolicy.hold` keeps later iterations back until it is released.
The runtime (:class:`~bytescheduler.core.scheduler.Scheduler`) drives it with real time
and real completions; tests drive it with a fake clock; a simulator can drive the very
same object with simulated time.

>>> from bytescheduler.core.task import Task
>>> policy = SchedulingPolicy(partition_bytes=16, credit_bytes=32)
>>> for key, numel, priority in [(0, 40, 2), (1, 4, 0), (2, 4, 1)]:
...     _ = policy.add(Task(key, numel, itemsize=1, priority=priority, payload=None, fuse_key="f32"), now=0.0)
>>> [(op.nbytes, [p.task.key for p in op.pieces]) for op in policy.decide(now=0.0)]
[(8, [1, 2]), (16, [0])]
>>> policy.decide(now=0.0), policy.queued_bytes  # the credit is full
([], 24)
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Tuple

from .credit import CreditWindow
from .task import Operation, Piece, Task


class SchedulingPolicy:
    """Priority, partition, merge, credit, fast lane and cycle: every choice rank 0 makes.

    Args:
        partition_bytes: largest piece, and largest merged operation on the main lane.
        credit_bytes: bytes in flight at most on the main lane (one larger piece may go
            alone when nothing is in flight).
        merge: fuse consecutive heap-top pieces of tasks with equal, non-None fuse keys.
        fast_lane_bytes: operations this small go to lane 1 under a window of their own;
            0 (or ``lanes == 1``) turns the fast lane off.
        lanes: how many FIFO lanes the backend has.
        cycle_seconds: how long queued work smaller than ``partition_bytes`` may be held
            so more arrives to merge with (see :meth:`hold_remaining`); 0: never held.

    Not thread-safe: its owner calls it under one lock. Times are seconds on any clock.
    """

    def __init__(
        self,
        partition_bytes: int,
        credit_bytes: int,
        merge: bool = True,
        fast_lane_bytes: int = 0,
        lanes: int = 1,
        cycle_seconds: float = 0.0,
    ) -> None:
        self.partition_bytes = partition_bytes
        self.merge = merge
        self.fast_lane_bytes = fast_lane_bytes
        self.cycle_seconds = cycle_seconds
        self.main = CreditWindow(credit_bytes)
        self.fast: Optional[CreditWindow] = CreditWindow(fast_lane_bytes) if lanes > 1 and fast_lane_bytes > 0 else None
        # (iteration, priority, arrival, a task's pieces not yet decided): tuples compare in
        # C, arrival is unique. One entry per task, its pieces cut as they go: the order is
        # that of one entry per piece (a task's pieces share its priority and arrive
        # together), at one heap operation per task instead of two per piece.
        #
        # The iteration comes first: a rank's next forward waits for the parameters it uses,
        # and only for those. A parameter rank 0 does not use in iteration i+1 (a skipped
        # branch) may still be queued from iteration i when rank 0's gradients of i+1 arrive;
        # another rank that uses it cannot get to its own gradients of i+1 before it is
        # averaged. Were i+1's more urgent pieces to go first, they would fill the credit
        # with operations that rank can never join. Where every rank uses every parameter,
        # all of iteration i is done before any gradient of i+1 exists, so this order costs
        # nothing there. For the same reason no operation merges two iterations: that rank
        # could join the operation only after it completed.
        self._heap: List[Tuple[int, float, int, "_Queued"]] = []
        # iteration -> holds (see hold()); later iterations wait while one is held
        self._holds: Dict[int, int] = {}
        self._arrivals = 0
        self._op_ids = 0
        self.queued_bytes = 0
        self._hold_since = 0.0
        self._hurry = False  # the burst ended: what is queued goes without waiting
        self._draining = False  # stopping: nothing is held any more
        self._main_priorities: Dict[int, float] = {}  # op id -> priority, main lane in flight

    # ------------------------------------------------------------------ events

    def add(self, task: Task, now: float) -> bool:
        """``task`` is ready: queue its pieces (cut at the partition size in force now).

        Returns True when its driver should ask :meth:`decide` (now, or when a hold that
        begins with this task ends): while the credit is full there is nothing to do.
        """
        begins = not self._heap
        if begins:
            self._hold_since = now
        numel = task.numel
        if numel > 0:
            self._arrivals += 1
            nbytes = numel * task.itemsize
            step = numel if nbytes <= self.partition_bytes else max(1, self.partition_bytes // task.itemsize)
            heapq.heappush(self._heap, (task.iteration, task.priority, self._arrivals, _Queued(task, step, now)))
            self.queued_bytes += nbytes
        return (begins and self.cycle_seconds > 0) or self.can_launch(now)

    def finished(self, op: Operation) -> None:
        """``op`` (one this policy decided) completed: its credit is free again."""
        if op.lane == 0 or self.fast is None:
            self.main.in_flight -= op.nbytes
            self._main_priorities.pop(op.op_id, None)  # kept (by decide) only with a fast lane
        else:
            self.fast.in_flight -= op.nbytes

    def hold(self, iteration: int) -> None:
        """More of ``iteration`` is coming that nothing of this rank's queue shows yet (e.g.
        tensors decided only once a collective of that iteration is back): launch nothing of a
        later iteration until :meth:`release`. Holds count: each needs its release."""
        self._holds[iteration] = self._holds.get(iteration, 0) + 1

    def release(self, iteration: int) -> bool:
        """End one :meth:`hold` of ``iteration``; True when the queue may go further now."""
        count = self._holds.get(iteration, 0) - 1
        if count > 0:
            self._holds[iteration] = count
            return False
        self._holds.pop(iteration, None)
        return bool(self._heap)

    def _held_beyond(self) -> Optional[int]:
        """The last iteration that may launch now; None when nothing is held."""
        return min(self._holds) if self._holds else None

    def end_burst(self) -> bool:
        """No more tasks are coming soon: stop holding what is queued. True if that changed anything."""
        if self._heap and not self._hurry:
            self._hurry = True
            return True
        return False

    def drain(self) -> None:
        """The scheduler is stopping: never hold work again."""
        self._draining = True

    def clear(self) -> None:
        """Forget queued work and operations in flight (after a failure)."""
        self._heap.clear()
        self._holds.clear()
        self.queued_bytes = 0
        self._main_priorities.clear()

    def reconfigure(self, partition_bytes: Optional[int] = None, credit_bytes: Optional[int] = None) -> None:
        """New sizes from now on; pieces already queued keep theirs."""
        if partition_bytes is not None:
            self.partition_bytes = partition_bytes
        if credit_bytes is not None:
            self.main.capacity = credit_bytes

    # ------------------------------------------------------------------ questions

    @property
    def queued(self) -> int:
        """How many pieces wait in the queue."""
        return sum(-(-(entry.task.numel - entry.start) // entry.step) for *_, entry in self._heap)

    def window(self, lane: int) -> CreditWindow:
        """The credit window of ``lane``."""
        return self.fast if lane == 1 and self.fast is not None else self.main

    def hold_remaining(self, now: float) -> float:
        """Seconds queued work may still wait for more to merge with; 0 when it must go.

        Work is held while less than one operation's worth (``partition_bytes``) is queued,
        for at most ``cycle_seconds`` after the queue became non-empty, unless the burst
        ended or the scheduler drains. Without ``merge`` nothing would come of holding.
        """
        cycle = self.cycle_seconds
        if cycle <= 0 or not self.merge or self._hurry or self._draining or not self._heap:
            return 0.0
        if self.queued_bytes >= self.partition_bytes:
            return 0.0
        return max(0.0, self._hold_since + cycle - now)

    def can_launch(self, now: float) -> bool:
        """True when :meth:`decide` would return an operation now."""
        if not self._heap or self.hold_remaining(now) > 0:
            return False
        first = self._heap[0][3]
        limit = self._held_beyond()
        if limit is not None and first.task.iteration > limit:
            return False
        nbytes = first.next_bytes()
        window, _, _ = self._lane_for(first.task.priority, nbytes)
        return window.admits(nbytes)

    def wake_on_completion(self, now: float) -> bool:
        """After :meth:`finished`: True when the freed credit lets queued work go."""
        return self.can_launch(now)

    # ------------------------------------------------------------------ decisions

    def _lane_for(self, priority: float, nbytes: int) -> Tuple[CreditWindow, int, int]:
        """The credit window, lane and merge limit of an operation starting with a piece of
        ``nbytes`` and ``priority``.

        Small operations take the fast lane. A larger piece takes it too when the fast lane
        is idle and every operation in flight on the main lane is less urgent: in the
        backend's first-in-first-out queue it would otherwise wait for all of them (e.g. a
        first layer's gradient of a few MiB behind the last layers' pieces).
        """
        fast = self.fast
        if fast is not None:
            if nbytes <= self.fast_lane_bytes:
                return fast, 1, self.fast_lane_bytes
            if fast.in_flight == 0 and self._main_priorities and priority < min(self._main_priorities.values()):
                return fast, 1, nbytes
        return self.main, 0, self.partition_bytes

    def decide(self, now: float, most: Optional[int] = None) -> List[Operation]:
        """Pop what the credit admits now (at most ``most`` operations), most urgent first,
        fusing small neighbours.

        Returns nothing while the queue is held for merging (:meth:`hold_remaining`).
        The operations count as in flight from here until :meth:`finished`.
        """
        heap = self._heap
        ops: List[Operation] = []
        if not heap or self.hold_remaining(now) > 0:
            return ops
        # The loop runs once per operation (many thousand a second): locals, no method calls on
        # the path of a partitioned tensor's piece, the heap's top taken in place.
        merge = self.merge
        fast = self.fast
        main = self.main
        priorities = self._main_priorities
        op_id = self._op_ids
        last_id = op_id + most if most is not None else -1
        held_beyond = self._held_beyond()
        decided = 0
        while heap and op_id != last_id:
            entry = heap[0][3]
            task = entry.task
            if held_beyond is not None and task.iteration > held_beyond:
                break
            numel = task.numel
            start = entry.start
            stop = start + entry.step
            if stop > numel:
                stop = numel
            nbytes = (stop - start) * task.itemsize
            if fast is None:  # _lane_for's answer without a fast lane
                window, lane, limit = main, 0, self.partition_bytes
            else:
                window, lane, limit = self._lane_for(task.priority, nbytes)
            in_flight = window.in_flight
            if in_flight and in_flight + nbytes > window.capacity:  # CreditWindow.admits
                break
            entry.start = stop  # _Queued.take, inline
            if stop >= numel:
                heapq.heappop(heap)
            first = Piece(task, start, stop, entry.queued_time)
            merged: Optional[List[Piece]] = None  # a list only once a neighbour merges in
            total = nbytes
            fuse_key = task.fuse_key
            if merge and fuse_key is not None:
                iteration = task.iteration
                room = window.capacity - in_flight
                if room > limit:
                    room = limit
                # A piece that fills the room leaves none for a neighbour (pieces are never empty).
                while total < room and heap:
                    candidate = heap[0][3]
                    size = total + candidate.next_bytes()
                    # One operation holds one iteration: a rank may be able to submit the
                    # next iteration's tensors only once this one's are averaged (see _heap).
                    if candidate.task.fuse_key != fuse_key or size > room or candidate.task.iteration != iteration:
                        break
                    if merged is None:
                        merged = [first]
                    merged.append(candidate.take(heap))
                    total = size
            in_flight += total  # CreditWindow.take, inline
            window.in_flight = in_flight
            if in_flight > window.peak:
                window.peak = in_flight
            decided += total
            op_id += 1
            if fast is not None and lane == 0:
                priorities[op_id] = task.priority
            ops.append(Operation((first,) if merged is None else merged, lane, op_id, total))
        self._op_ids = op_id
        self.queued_bytes -= decided
        if not heap:
            self._hurry = False  # the next task starts a new cycle
        return ops


class _Queued:
    """A queued task's pieces not yet decided: ``[start, numel)``, cut every ``step`` elements."""

    __slots__ = ("task", "step", "start", "queued_time")

    def __init__(self, task: Task, step: int, now: float) -> None:
        self.task = task
        self.step = step
        self.start = 0
        self.queued_time = now

    def next_bytes(self) -> int:
        """The size of the next piece."""
        task = self.task
        return (min(self.start + self.step, task.numel) - self.start) * task.itemsize

    def take(self, heap: List[Tuple[int, float, int, "_Queued"]]) -> Piece:
        """Cut the next piece (this entry is the heap's top); pop the entry after its last."""
        start = self.start
        numel = self.task.numel
        stop = min(start + self.step, numel)
        self.start = stop
        if stop >= numel:
            heapq.heappop(heap)
        return Piece(self.task, start, stop, self.queued_time)
