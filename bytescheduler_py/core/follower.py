"""The follower: replays rank 0's decisions on another rank, in order.

Rank 0 publishes each decided operation as ``(lane, [(key, generation, start, stop), ...])``
(:mod:`bytescheduler.core.ordering`). A follower issues exactly those operations, in that
order, each as soon as every tensor it names has been submitted here. Like the policy,
:class:`Follower` is a pure object: the runtime feeds it received decisions and its own
submitted tasks, and asks it which operations may go now.

>>> from bytescheduler.core.ledger import Ledger
>>> from bytescheduler.core.task import Task
>>> ledger = Ledger(rank=1)
>>> follower = Follower(rank=1, lanes=1, ledger=ledger)
>>> follower.receive([(0, [(7, 0, 0, 4)])], now=0.0)
>>> follower.decide(now=0.0)  # tensor 7 is not submitted here yet
[]
>>> task = Task(key=7, numel=4, itemsize=4, priority=0, payload=None)
>>> ledger.add(task); follower.add(task, now=0.0)
True
>>> [op.nbytes for op in follower.decide(now=0.0)]
[16]
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .credit import CreditWindow
from .errors import MismatchError
from .ledger import Ledger
from .ordering import Decision
from .task import Operation, Piece, Task


class Follower:
    """Decisions received from rank 0 and not yet issued, oldest first.

    ``undecided_elements`` counts the elements this rank submitted that rank 0 has not
    decided yet: the runtime reads from the channel only while it is positive, so time
    between iterations never counts against a timeout. The windows only account bytes in
    flight (for statistics): a follower never enforces the credit, rank 0 did.

    It answers the runtime as :class:`~bytescheduler.core.policy.SchedulingPolicy` does
    (``add``, ``decide``, ``finished``, ...); what only rank 0 does (holding work to merge,
    draining, resizing) costs nothing here. The ``ledger`` holds this rank's tasks.
    """

    cycle_seconds = 0.0

    def __init__(self, rank: int, lanes: int, ledger: Ledger) -> None:
        self.rank = rank
        self._lanes = lanes
        self._ledger = ledger
        self._decided: Deque[Tuple[float, Decision]] = deque()
        self._op_ids = 0
        self.undecided_elements = 0
        self.stop_received = False
        # Keys whose task this rank makes only when rank 0 schedules it: ``provider(generation)``
        # returns it, or None while it cannot be made yet (see Scheduler.provide).
        self.providers: Dict[int, Callable[[int], Optional[Task]]] = {}
        # Provided tasks launched whose outcome the adapter has not applied yet (it calls
        # Scheduler.withdraw(fence=True)); no stand-in is claimed meanwhile.
        self.fences = 0
        self.main = CreditWindow(0)
        self.fast = CreditWindow(0)

    def window(self, lane: int) -> CreditWindow:
        return self.fast if lane == 1 else self.main

    # ------------------------------------------------------------------ events

    def add(self, task: Task, now: float) -> bool:
        """``task`` was submitted here; rank 0 will decide its pieces. True: read the channel."""
        self.undecided_elements += task.numel
        return True

    def receive(self, decisions: Sequence[Decision], now: float) -> None:
        """Rank 0's next decisions arrived at ``now``."""
        for decision in decisions:
            self._decided.append((now, decision))
            for _, _, start, stop in decision[1]:
                self.undecided_elements -= stop - start

    def finished(self, op: Operation) -> None:
        self.window(op.lane).release(op.nbytes)

    def clear(self) -> None:
        self._decided.clear()

    def hold_remaining(self, now: float) -> float:
        return 0.0

    def end_burst(self) -> bool:
        return False

    def drain(self) -> None:
        pass

    def reconfigure(self, partition_bytes: Optional[int] = None, credit_bytes: Optional[int] = None) -> None:
        pass

    def wake_on_completion(self, now: float) -> bool:
        """A completion matters to a follower's waiting threads only once rank 0 said STOP."""
        return self.stop_received

    # ------------------------------------------------------------------ decisions

    def decide(self, now: float, most: Optional[int] = None) -> List[Operation]:
        """The decided operations whose tensors are all submitted here, in decision order
        (at most ``most``).

        Stops at the first decision naming a tensor not submitted yet. Raises
        :class:`MismatchError` when a decision cannot be this rank's (a tensor already
        done, or a range beyond its size).
        """
        pending, generations = self._ledger.pending, self._ledger.generations
        ops: List[Operation] = []
        while self._decided and len(ops) != most:
            _, (lane, spec) = self._decided[0]
            pieces = []
            for key, generation, start, stop in spec:
                task = pending.get((key, generation))
                if task is None:
                    task = self._claim(key, generation, now)
                if task is None:
                    if generation < generations.get(key, 0):
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
                pieces.append(Piece(task, start, stop, task.ready_time))
            self._decided.popleft()
            self._op_ids += 1
            op = Operation(pieces, min(lane, self._lanes - 1), self._op_ids)
            self.window(op.lane).take(op.nbytes)
            ops.append(op)
        return ops

    def _claim(self, key: int, generation: int, now: float) -> Optional[Task]:
        """A task rank 0 scheduled that was not submitted here: a stand-in this rank offered
        (unless a provided task's outcome is still to be applied), or a provider's."""
        if (key, generation) in self._ledger.standby:
            if self.fences:
                return None
            task = self._ledger.claim(key, generation)
            task.ready_time = now  # waits for rank 0 count from here
            return task
        provider = self.providers.get(key)
        if provider is None:
            return None
        task = provider(generation)
        if task is not None:
            task.generation = generation
            task.ready_time = now
            self._ledger.add(task)
            self.undecided_elements += task.numel  # its decision was counted on arrival
            self.fences += 1
        return task

    def check_overdue(self, now: float, limit: float) -> None:
        """Raise when a decision waited ``limit`` s for tensors this rank never submitted, or a
        tensor waited that long for a decision."""
        pending = self._ledger.pending
        if self._decided and now - self._decided[0][0] > limit:
            _, pieces = self._decided[0][1]
            missing = [p[:2] for p in pieces if (p[0], p[1]) not in pending]
            raise MismatchError(
                f"rank {self.rank}: rank 0 scheduled tensor(s) (key, generation) {missing} that this "
                f"rank has not submitted within {limit} s; every rank must submit the same tensors"
            )
        self._ledger.check_undecided(now, limit)

    def drained(self) -> bool:
        """True once rank 0 said STOP and every decision was issued and finished.

        Raises :class:`MismatchError` when tensors of this rank are left that rank 0 never had.
        """
        if not self.stop_received or self._decided or self._ledger.in_flight:
            return False
        if self._ledger.pending:
            raise MismatchError(
                f"rank {self.rank}: rank 0 stopped while this rank still had "
                f"{len(self._ledger.pending)} tensor(s) to communicate; every rank must submit the same tensors"
            )
        return True
