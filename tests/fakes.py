"""A fake communication backend for the scheduling core's unit tests.

It records every launched operation (order, pieces, lane, bytes), keeps its own count of
the bytes in flight (to check the credit independently of the scheduler), and completes
operations in one of three ways:

* ``"immediate"``: ``done`` is called inside ``launch`` (before it returns);
* ``"manual"``: operations are held until the test calls :meth:`FakeBackend.release`;
* ``"pool"``: a thread pool completes them after a random delay, in random order.

``fail`` (a callable ``op -> exception or None``) injects errors.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Tuple

from bytescheduler.core import Operation, Task

WAIT = 5.0  # seconds a test waits for something that should happen promptly


@dataclass
class OpRecord:
    index: int
    op: Operation
    lane: int
    nbytes: int
    # (key, generation, start, stop) of each piece, in the operation's order.
    pieces: List[Tuple[int, int, int, int]]
    in_flight_before: int
    in_flight_after: int
    thread: str = field(default="")

    @property
    def keys(self) -> List[int]:
        return [p[0] for p in self.pieces]

    @property
    def signature(self):
        """What must be identical on every rank: lane and pieces."""
        return (self.lane, tuple(self.pieces))


class FakeBackend:
    def __init__(
        self,
        mode: str = "immediate",
        num_lanes: Optional[int] = None,
        credit: Optional[int] = None,
        fail: Optional[Callable[[Operation], Optional[BaseException]]] = None,
        delay: Tuple[float, float] = (0.0, 0.002),
        workers: int = 4,
        seed: Optional[int] = None,
    ) -> None:
        assert mode in ("immediate", "manual", "pool"), mode
        self.mode = mode
        if num_lanes is not None:
            self.num_lanes = num_lanes
        self.credit = credit
        self.fail = fail
        self.delay = delay
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self.ops: List[OpRecord] = []
        self.in_flight_bytes = 0
        self.peak_in_flight_bytes = 0
        self.completed = 0
        self.violations: List[str] = []
        # Exceptions raised by the scheduler's ``done`` callback (it should never raise).
        self.callback_errors: List[BaseException] = []
        self.held: Deque[Tuple[OpRecord, Callable, Optional[BaseException]]] = deque()
        self._pool = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake-backend") if mode == "pool" else None
        )

    # ------------------------------------------------------------------ backend protocol

    def launch(self, op: Operation, done: Callable[[Optional[BaseException]], None]) -> None:
        with self._cond:
            before = self.in_flight_bytes
            self.in_flight_bytes += op.nbytes
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)
            record = OpRecord(
                index=len(self.ops),
                op=op,
                lane=op.lane,
                nbytes=op.nbytes,
                pieces=[(p.task.key, p.task.generation, p.start, p.stop) for p in op.pieces],
                in_flight_before=before,
                in_flight_after=self.in_flight_bytes,
                thread=threading.current_thread().name,
            )
            if op.nbytes != sum(p.nbytes for p in op.pieces):
                self.violations.append(f"{op}: nbytes is not the sum of its pieces")
            if self.credit is not None and self.in_flight_bytes > self.credit and before != 0:
                self.violations.append(
                    f"{op} launched with {before} B already in flight: {self.in_flight_bytes} B > "
                    f"credit {self.credit} B"
                )
            self.ops.append(record)
            self._cond.notify_all()
        error = self.fail(op) if self.fail is not None else None
        if self.mode == "immediate":
            self._complete(record, done, error)
        elif self.mode == "manual":
            with self._cond:
                self.held.append((record, done, error))
                self._cond.notify_all()
        else:
            wait = self._rng.uniform(*self.delay)
            self._pool.submit(self._complete_later, wait, record, done, error)

    # ------------------------------------------------------------------ completion

    def _complete_later(self, wait, record, done, error) -> None:
        time.sleep(wait)
        self._complete(record, done, error)

    def _complete(self, record: OpRecord, done, error: Optional[BaseException]) -> None:
        # Account before calling done: the scheduler may launch the next operation from
        # inside done's notification, and our count must never be the larger one.
        with self._cond:
            self.in_flight_bytes -= record.nbytes
            self.completed += 1
            self._cond.notify_all()
        try:
            done(error)
        except BaseException as callback_error:
            with self._cond:
                self.callback_errors.append(callback_error)
            raise

    def release(self, count: int = 1) -> List[OpRecord]:
        """Complete the ``count`` oldest held operations (waiting for them to be launched)."""
        released = []
        for _ in range(count):
            with self._cond:
                if not self._cond.wait_for(lambda: self.held, timeout=WAIT):
                    raise AssertionError(f"no held operation to release after {WAIT} s; launched: {self.describe()}")
                record, done, error = self.held.popleft()
            self._complete(record, done, error)
            released.append(record)
        return released

    def release_until_done(self, futures, timeout: float = WAIT) -> int:
        """Release held operations one by one until every future is done."""
        deadline = time.monotonic() + timeout
        count = 0
        while not all(f.done() for f in futures):
            with self._cond:
                # A future is set just after its last operation's done(): poll briefly.
                self._cond.wait_for(lambda: self.held, timeout=0.01)
                item = self.held.popleft() if self.held else None
            if item is not None:
                self._complete(*item)
                count += 1
            elif time.monotonic() > deadline:
                raise AssertionError(f"futures not done after {timeout} s; launched: {self.describe()}")
        return count

    def release_all(self) -> int:
        count = 0
        while True:
            with self._cond:
                if not self.held:
                    return count
                record, done, error = self.held.popleft()
            self._complete(record, done, error)
            count += 1

    # ------------------------------------------------------------------ observation

    def wait_launched(self, count: int, timeout: float = WAIT) -> List[OpRecord]:
        """Wait until at least ``count`` operations were launched; return all records."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.ops) >= count, timeout=timeout):
                raise AssertionError(f"expected {count} launched operations, got {self.describe()}")
            return list(self.ops)

    def wait_held(self, count: int, timeout: float = WAIT) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.held) >= count, timeout=timeout):
                raise AssertionError(f"expected {count} held operations, got {len(self.held)}")

    def wait_idle(self, timeout: float = WAIT) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.in_flight_bytes == 0 and not self.held, timeout=timeout):
                raise AssertionError(f"backend still has {self.in_flight_bytes} B in flight")

    def launched_keys(self) -> List[List[int]]:
        with self._cond:
            return [r.keys for r in self.ops]

    def describe(self) -> str:
        return "[" + ", ".join(f"#{r.index} lane{r.lane} {r.nbytes}B {r.pieces}" for r in self.ops) + "]"

    def close(self) -> None:
        try:
            self.release_all()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def make_task(key, numel, itemsize=1, priority=0, fuse_key=None, name=None) -> Task:
    return Task(key=key, numel=numel, itemsize=itemsize, priority=priority, payload=None,
                fuse_key=fuse_key, name=name)


def scheduler_threads(before) -> List[threading.Thread]:
    """bytescheduler threads alive now that were not in ``before``."""
    return [t for t in threading.enumerate() if t.name.startswith("bytescheduler") and t not in before]
