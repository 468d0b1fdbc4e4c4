"""The units the scheduler moves: a task (one tensor), its pieces, and operations."""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, List, Optional, Sequence

from .log import logger


class TaskFuture:
    """The outcome of one task: a light subset of :class:`concurrent.futures.Future`.

    ``done()``, ``result(timeout)``, ``exception(timeout)`` and ``add_done_callback(fn)``
    behave as in ``concurrent.futures``; callbacks run in the thread that completes the
    task (or at once if it is already done). A callback that raises does not keep the
    others from running: the first such exception is logged and returned by
    ``set_result``/``set_exception``, so whoever completes the task can report it. It is lighter than the standard future (no
    condition variable unless someone waits), which matters at one future per tensor.
    """

    __slots__ = ("_done", "_result", "_exception", "_callbacks", "_event")

    # One lock for every future: each holds it for a few statements, and a lock per future
    # was an allocation per tensor on the training thread.
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._done = False
        self._result: Any = None
        self._exception: Optional[BaseException] = None
        self._callbacks: List[Callable[["TaskFuture"], None]] = []
        self._event: Optional[threading.Event] = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def _wait(self, timeout: Optional[float]) -> None:
        if self._done:
            return
        with self._lock:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"task not communicated within {timeout} s")

    def result(self, timeout: Optional[float] = None) -> Any:
        self._wait(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self._wait(timeout)
        return self._exception

    def add_done_callback(self, fn: Callable[["TaskFuture"], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: Any, exception: Optional[BaseException]) -> Optional[BaseException]:
        with self._lock:
            if self._done:
                return None
            self._result, self._exception = result, exception
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        # Every callback runs, whatever an earlier one did: one raising must not leave the
        # others' tasks unresolved, nor escape into the backend's thread that completes us.
        first: Optional[BaseException] = None
        for callback in callbacks:
            try:
                callback(self)
            except Exception as error:  # noqa: BLE001 - handed to the caller below
                logger.error("a done-callback of %r raised %s: %s", self._result, type(error).__name__, error)
                if first is None:
                    first = error
        return first

    def set_result(self, result: Any) -> Optional[BaseException]:
        """Resolve with ``result`` and run the callbacks; return the first exception one raised."""
        return self._finish(result, None)

    def set_exception(self, exception: BaseException) -> Optional[BaseException]:
        """Fail with ``exception`` and run the callbacks; return the first exception one raised."""
        return self._finish(None, exception)


class Task:
    """One tensor's communication.

    key: an integer naming the tensor, identical on every rank (e.g. a parameter or
        bucket index). Each submission of the same key is a new *generation*.
    numel, itemsize: size of the flat payload in elements and bytes per element.
    priority: lower goes sooner (the tensor's position in forward order).
    payload: whatever the backend needs to find the bytes (e.g. a flat tensor);
        the core never looks inside it.
    fuse_key: tasks with equal, non-None fuse keys may be merged into one operation
        (e.g. same dtype and device); None means never merge.
    iteration: the training iteration the tensor belongs to, counted alike on every rank
        (set after construction; 0 for adapters that do not count): rank 0 launches every
        task of an earlier iteration before any of a later one
        (:class:`~bytescheduler.core.policy.SchedulingPolicy`).
    """

    __slots__ = (
        "key",
        "generation",
        "numel",
        "itemsize",
        "priority",
        "payload",
        "fuse_key",
        "future",
        "remaining",
        "ready_time",
        "_name",
        "context",
        "writes",
        "iteration",
    )

    def __init__(
        self,
        key: int,
        numel: int,
        itemsize: int,
        priority: float,
        payload: Any,
        fuse_key: Optional[Hashable] = None,
        name: Optional[str] = None,
        context: Any = None,
    ) -> None:
        self.key = int(key)
        self.generation = -1
        self.numel = int(numel)
        self.itemsize = int(itemsize)
        self.priority = priority
        self.payload = payload  # released (None) once the task is communicated
        self.fuse_key = fuse_key
        self.future = TaskFuture()
        self.remaining = self.numel
        self.ready_time = 0.0
        self._name = name  # None: named after the key when asked (no formatting per tensor)
        self.context = context
        # In-place writes the backend made to the payload besides communicating into it
        # (e.g. copying a fused result back): adapters compare tensor versions with it.
        self.writes = 0
        self.iteration = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def name(self) -> str:
        """The tensor's name for logs and the timeline (``key<N>`` when none was given)."""
        return self._name if self._name is not None else f"key{self.key}"

    @name.setter
    def name(self, value: Optional[str]) -> None:
        self._name = value

    def __repr__(self) -> str:
        return (
            f"Task({self.name!r}, key={self.key}, generation={self.generation}, "
            f"numel={self.numel}, priority={self.priority})"
        )


class Piece:
    """A contiguous element range ``[start, stop)`` of a task's flat payload."""

    __slots__ = ("task", "start", "stop", "nbytes", "queued_time")

    def __init__(self, task: Task, start: int, stop: int, queued_time: float = 0.0) -> None:
        self.task = task
        self.start = start
        self.stop = stop
        self.nbytes = (stop - start) * task.itemsize
        self.queued_time = queued_time

    def __repr__(self) -> str:
        return f"Piece({self.task.name!r}, [{self.start}, {self.stop}))"


class Operation:
    """One backend call: a single piece, or several small pieces fused together.

    Launched, it is also its own completion callback: the runtime hands the operation itself
    to the backend as ``done``, and ``op(error)`` reports to whoever launched it. One object
    less per operation in flight (a ``functools.partial`` was one more object for the garbage
    collector to traverse while thousands of small operations wait; see
    docs/microbenchmark.md).
    """

    __slots__ = ("pieces", "lane", "nbytes", "op_id", "launch_time", "context", "_report")

    def __init__(self, pieces: Sequence[Piece], lane: int, op_id: int, nbytes: Optional[int] = None) -> None:
        self.pieces = pieces
        self.lane = lane
        self.nbytes = sum(p.nbytes for p in pieces) if nbytes is None else nbytes
        self.op_id = op_id
        self.launch_time = 0.0
        self.context: Any = None
        self._report: Optional[Callable[["Operation", Optional[BaseException]], None]] = None

    def on_done(self, report: Callable[["Operation", Optional[BaseException]], None]) -> "Operation":
        """Make ``self(error)`` call ``report(self, error)``; returns the operation, the callback."""
        self._report = report
        return self

    def __call__(self, error: Optional[BaseException]) -> None:
        """The operation finished (``error`` None) or failed: tell whoever launched it."""
        self._report(self, error)

    @property
    def fused(self) -> bool:
        return len(self.pieces) > 1

    def __repr__(self) -> str:
        return f"Operation(#{self.op_id}, lane={self.lane}, {self.nbytes} B, {self.pieces})"
