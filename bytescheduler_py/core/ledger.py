"""The ledger: which tasks were submitted, which operations are in flight, what is done.

Each submission of a key is a new *generation*, so a rank can tell this iteration's
tensor from the last one's. An operation in flight holds pieces of one or more tasks; a
task is done when all its elements came back. Like the policy, :class:`Ledger` is a pure
object (no thread, no clock): the runtime keeps it under its lock.

>>> from bytescheduler.core.task import Operation, Piece, Task
>>> ledger = Ledger(rank=0)
>>> task = Task(key=3, numel=8, itemsize=4, priority=0, payload=None)
>>> ledger.add(task); task.generation
0
>>> op = Operation([Piece(task, 0, 8)], lane=0, op_id=1)
>>> ledger.launched([op], now=0.0); [t.key for t in ledger.complete(op)], ledger.pending
([3], {})
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .errors import CommunicationTimeout
from .task import Operation, Task


class Ledger:
    """Tasks submitted and not done (by key and generation) and operations in flight (by id)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pending: Dict[Tuple[int, int], Task] = {}
        self.generations: Dict[int, int] = {}
        self.in_flight: Dict[int, Operation] = {}
        # A follower's tasks offered in case rank 0 schedules them (see Scheduler.offer):
        # not pending until claimed, so nothing waits for them.
        self.standby: Dict[Tuple[int, int], Task] = {}

    def add(self, task: Task) -> None:
        """Record a submitted task and give it its key's next generation (or keep the one
        it was given: an adapter that numbers a key's submissions itself)."""
        generation = task.generation
        if generation < 0:
            generation = task.generation = self.generations.get(task.key, 0)
        self.generations[task.key] = max(generation + 1, self.generations.get(task.key, 0))
        self.pending[(task.key, generation)] = task

    def offer(self, task: Task) -> None:
        """Hold ``task`` as its key's next generation without submitting it (a follower's
        stand-in, e.g. zeros for a parameter this rank's backward did not produce)."""
        task.generation = self.generations.get(task.key, 0)
        self.standby[(task.key, task.generation)] = task

    def claim(self, key: int, generation: int) -> Optional[Task]:
        """The stand-in offered for ``(key, generation)``, now submitted; None if there is none."""
        task = self.standby.pop((key, generation), None)
        if task is not None:
            self.add(task)
        return task

    def launched(self, ops: List[Operation], now: float) -> None:
        """``ops`` are in flight from ``now`` on (their deadlines count from here)."""
        in_flight = self.in_flight
        for op in ops:
            op.launch_time = now
            in_flight[op.op_id] = op

    def complete(self, op: Operation) -> Optional[Sequence[Task]]:
        """``op`` finished: the tasks it completed, or None for an operation no longer tracked
        (a late completion after a failure)."""
        if self.in_flight.pop(op.op_id, None) is None:
            return None
        finished: Optional[List[Task]] = None  # most pieces complete no task: no list for them
        for piece in op.pieces:
            task = piece.task
            remaining = task.remaining - (piece.stop - piece.start)
            task.remaining = remaining
            if remaining == 0 and self.pending.pop((task.key, task.generation), None):
                if finished is None:
                    finished = [task]
                else:
                    finished.append(task)
        return () if finished is None else finished

    def clear(self) -> List[Task]:
        """Forget everything (work given up); return the tasks that were pending."""
        tasks = list(self.pending.values())
        self.pending.clear()
        self.standby.clear()
        self.in_flight.clear()  # late completions of these are ignored
        return tasks

    def check_in_flight(self, now: float, limit: float) -> None:
        """Raise :class:`CommunicationTimeout` for an operation in flight longer than ``limit`` s."""
        for op in self.in_flight.values():
            if now - op.launch_time > limit:
                raise CommunicationTimeout(
                    f"rank {self.rank}: {op} did not finish within {limit} s; a peer may have died or "
                    "stopped submitting (set BYTESCHEDULER_TIMEOUT to change the limit)"
                )

    def check_undecided(self, now: float, limit: float) -> None:
        """A follower: raise :class:`CommunicationTimeout` for a task that waited longer than
        ``limit`` s for rank 0 to schedule it."""
        oldest = min((t.ready_time for t in self.pending.values()), default=now)
        if now - oldest > limit:
            raise CommunicationTimeout(
                f"rank {self.rank}: rank 0 has not scheduled tensors this rank submitted "
                f"{now - oldest:.0f} s ago; has rank 0 died or stopped submitting?"
            )
