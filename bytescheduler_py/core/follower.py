"""The follower: replays rank 0's decisions on another rank, in order.

Rank 0 publishes each decided operation as ``(lane, [(key, generation, start, stop), ...])``
(:mod:`bytescheduler.core.ordering`). A follower issues exactly those operations, in that
order, each as soon as every tensor it names has been submitted here. Like the policy,
:class:`Follower` is a pure object: the runtime feeds it received decisions and its own
submitted tasks, and asks it which operations may go now.

>>> from bytescheduler.core.task import Task
>>> follower = Follower(rank=1, lanes=1)
>>> follower.receive([(0, [(7, 0, 0, 4)])], now=0.0)
>>> follower.take(pending={}, generations={})  # tensor 7 is not ready here yet
[]
>>> task = Task(key=7, numel=4, itemsize=4, priority=0, payload=None); task.generation = 0
>>> [op.nbytes for op in follower.take(pending={(7, 0): task}, generations={7: 1})]
[16]
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Sequence, Tuple

from .credit import CreditWindow
from .errors import MismatchError
from .ordering import Decision
from .task import Operation, Piece, Task

Pending = Dict[Tuple[int, int], Task]


class Follower:
    """Decisions received from rank 0 and not yet issued, oldest first.

    ``undecided_elements`` counts the elements this rank submitted that rank 0 has not
    decided yet: the runtime reads from the channel only while it is positive, so time
    between iterations never counts against a timeout. The windows only account bytes in
    flight (for statistics): a follower never enforces the credit, rank 0 did.
    """

    def __init__(self, rank: int, lanes: int) -> None:
        self.rank = rank
        self._lanes = lanes
        self._decided: Deque[Tuple[float, Decision]] = deque()
        self._op_ids = 0
        self.undecided_elements = 0
        self.stop_received = False
        self.main = CreditWindow(0)
        self.fast = CreditWindow(0)

    def window(self, lane: int) -> CreditWindow:
        return self.fast if lane == 1 else self.main

    # ------------------------------------------------------------------ events

    def expect(self, task: Task) -> None:
        """``task`` was submitted here; rank 0 will decide its pieces."""
        self.undecided_elements += task.numel

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

    # ------------------------------------------------------------------ decisions

    def take(self, pending: Pending, generations: Dict[int, int]) -> List[Operation]:
        """The decided operations whose tensors are all submitted here, in decision order.

        Stops at the first decision naming a tensor not submitted yet. Raises
        :class:`MismatchError` when a decision cannot be this rank's (a tensor already
        done, or a range beyond its size).
        """
        ops: List[Operation] = []
        while self._decided:
            _, (lane, spec) = self._decided[0]
            pieces = []
            for key, generation, start, stop in spec:
                task = pending.get((key, generation))
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
                piece = Piece(task, start, stop)
                piece.queued_time = task.ready_time
                pieces.append(piece)
            self._decided.popleft()
            self._op_ids += 1
            op = Operation(pieces, min(lane, self._lanes - 1), self._op_ids)
            self.window(op.lane).take(op.nbytes)
            ops.append(op)
        return ops

    def check_overdue(self, now: float, limit: float, pending: Pending) -> None:
        """Raise when a decision has waited ``limit`` seconds for tensors this rank never submitted."""
        if self._decided and now - self._decided[0][0] > limit:
            _, pieces = self._decided[0][1]
            missing = [p[:2] for p in pieces if (p[0], p[1]) not in pending]
            raise MismatchError(
                f"rank {self.rank}: rank 0 scheduled tensor(s) (key, generation) {missing} that this "
                f"rank has not submitted within {limit} s; every rank must submit the same tensors"
            )

    def drained(self, pending: Pending, in_flight: int) -> bool:
        """True once rank 0 said STOP and every decision was issued and finished.

        Raises :class:`MismatchError` when tensors of this rank are left that rank 0 never had.
        """
        if not self.stop_received or self._decided or in_flight:
            return False
        if pending:
            raise MismatchError(
                f"rank {self.rank}: rank 0 stopped while this rank still had "
                f"{len(pending)} tensor(s) to communicate; every rank must submit the same tensors"
            )
        return True
