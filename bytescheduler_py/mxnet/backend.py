"""The ps-lite backend: every call on the inner MXNet store, made in the order rank 0 decided.

One order on every worker. Pushes enter the scheduler as their gradients are computed, at
slightly different moments on each worker. Were every worker to pick its own pieces under the
credit, two workers could fill it with different pieces, each waiting on the servers for the
other's push of it: a deadlock. So rank 0 decides, as in the torch adapters: its decisions go to
the other workers over a TCP connection (:class:`~bytescheduler.core.tcp_channel.TcpOrderChannel`),
set up at the first ``init`` or ``broadcast`` (:meth:`KVBackend.connect_channel`: rank 0's
address travels through the store, under a reserved key), and every worker issues exactly those
pieces in that order.

Threads. Every call on the inner store is made by one "kv thread" (MXNet's kvstore is not
thread safe); "waiter" threads learn completion through ``wait_to_read`` (``wait_to_write``
for a push) and tell the scheduler, each operation as soon as it finished (:class:`_Waiters`).
They belong to :class:`KVBackend`, the scheduler's
:class:`~bytescheduler.core.backend.Backend`. A "ready" thread (:class:`JobQueue`) hands a push
to the scheduler only once MXNet's engine told that its arrays are computed
(:mod:`~bytescheduler.mxnet.engine`), so communication overlaps the backward pass.

Order within a key: the next operation of a key is submitted to the scheduler only once the
previous one completed. Two pushes of one worker in flight for one key break the server's count
(it counts pushes, not workers), and a pull still in flight when the key's next push goes out
(e.g. the pull of ``broadcast``, which gluon's Trainer does in the same ``step`` as the first
push) may be answered with the next merged value: with ``update_on_kvstore=False`` unwrapped
MXNet then sets the weights to the gradient sum (see docs/mxnet.md).

When is an operation far enough along? MXNet's engine orders operations by the time they are
*queued*, so a forward (or an optimizer update, or a refill of a pushed array) queued before the
kv thread queued our call would run on the wrong data. So what waits for an operation waits
until every piece of it has been queued on the kv thread (:meth:`JobQueue.wait_queued`), not
until it completed; that includes waiting for the key's previous operation.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, List, Optional, Tuple

import mxnet as mx

from ..core.agreement import shared_settings, with_shared_settings
from ..core.backend import Done
from ..core.call_thread import CallThread
from ..core.config import SchedulerConfig
from ..core.errors import ByteSchedulerError, CommunicationError, CommunicationTimeout, ErrorLatch, reraise
from ..core.scheduler import Scheduler
from ..core.task import Operation
from ..core.tcp_channel import TcpOrderChannel, local_address
from .engine import when_readable
from .keys import KeyInfo, mx_args, rank0_json

# Room for rank 0's settings (JSON) in the exchange of its ordering address.
_SETTINGS_BYTES = 1024

# What tells an issued call's completion: (array, True) to wait until writable (a push reads
# it), (array, False) to wait until readable (a pull writes it).
_Waits = List[Tuple[Any, bool]]

# Waiter threads per store; more operations in flight queue for the next free one. The default
# credit (64 MiB of 4 MiB pieces) keeps 16-30 operations in flight.
_WAITERS = 32


def wait_to_write(arr: Any) -> None:
    """Wait until every operation queued on ``arr`` finished, reads included (a push reads).

    MXNet's Python API has only ``wait_to_read``, which does not wait for reads.
    """
    mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(arr.handle))


class _KVThread(CallThread):
    """Runs callables one at a time on a single thread (every call on the inner store)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "the ScheduledKVStore was closed")
        self.start()

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise CommunicationTimeout(
                f"{what} did not finish within {timeout} s on the kvstore thread; a peer may have "
                "died (set timeout= or BYTESCHEDULER_TIMEOUT to change the limit)") from None


class _Waiters:
    """Learns when issued operations finished and reports each one as soon as it did.

    MXNet's Python API has no completion callback, only blocking waits. A single thread that
    waits for the operations in the order they were issued reports one that finished early (a
    small key whose server is local, the first layers' pieces issued behind a large layer)
    only once every older one finished, and its credit stays taken meanwhile: the first
    layers' pieces would be reported hundreds of milliseconds after they were done, and the
    most urgent large layer would wait that long for credit. So up to ``count`` operations in
    flight each have a thread of their own blocked on them. The threads start with the store
    (daemon threads: a peer's death must not hold up the interpreter's exit); started on
    demand, a new peak of operations late in training would add threads, which reads as a
    leak (the soak test's flat thread count).
    """

    def __init__(self, rank: int, count: int = _WAITERS) -> None:
        self._rank = rank
        self._queue: "queue.SimpleQueue[Optional[Tuple[_Waits, Done]]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"bytescheduler-wait-r{rank}-{index}", daemon=True)
                         for index in range(count)]
        for thread in self._threads:
            thread.start()

    def put(self, waits: _Waits, done: Done) -> None:
        """Call ``done`` (on a waiter thread) once every array of ``waits`` is done."""
        self._queue.put((waits, done))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            waits, done = item
            try:
                for arr, write in waits:
                    if write:
                        wait_to_write(arr)
                    else:
                        arr.wait_to_read()
                error = None
            except BaseException as exc:  # noqa: BLE001
                error = CommunicationError(f"rank {self._rank}: kvstore operation failed: {exc}")
            done(error)

    def close(self, timeout: float) -> bool:
        """Stop every waiter thread once the operations queued before finished; False when
        one did not stop within ``timeout`` s."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


class Job:
    """One scheduled ``push``, ``pull`` or ``pushpull`` of one key (the payload of its task)."""

    __slots__ = ("kind", "info", "values", "outs", "priority", "ignore_sparse", "task", "queued",
                 "unqueued", "latch", "lock")

    def __init__(self, kind: str, info: KeyInfo, values: List[Any], outs: List[Any], priority: int,
                 ignore_sparse: bool = True) -> None:
        self.kind = kind
        self.info = info
        self.values = values  # arrays pushed (push, pushpull)
        self.outs = outs  # arrays pulled into (pull, pushpull)
        self.priority = priority
        self.ignore_sparse = ignore_sparse
        self.task = info.task(self, -priority)  # MXNet: higher goes sooner; the core: lower
        self.queued = threading.Event()  # every piece's call is queued on the kv thread, or failed
        self.unqueued = self.task.numel  # sub-keys not queued yet
        self.latch = ErrorLatch()
        self.lock = threading.Lock()

    def mark_queued(self, subkeys: int) -> None:
        with self.lock:
            self.unqueued -= subkeys
            if self.unqueued == 0:
                self.queued.set()

    def fail(self, error: BaseException) -> None:
        """The job cannot be queued (the first error is kept); whoever waits for it raises."""
        self.latch.set(error)
        self.queued.set()


class KVBackend:
    """The scheduler's backend over the inner store: each piece is one call on the kv thread.

    ``launch`` queues the calls of an operation's pieces on the kv thread and returns; a
    waiter thread calls ``done`` once MXNet has finished them.
    """

    def __init__(self, inner: Any, rank: int, num_workers: int, timeout: float) -> None:
        self._inner = inner
        self._rank = rank
        self._num_workers = num_workers
        self.timeout = timeout
        self._kv = _KVThread(f"bytescheduler-kv-r{rank}")
        self._waiters = _Waiters(rank)

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the kv thread and return its result (``what`` names it in a timeout)."""
        return self._kv.call(fn, self.timeout, what)

    def connect_channel(self, channel: TcpOrderChannel, key: Any, settings: SchedulerConfig,
                        grain: Optional[int]) -> Tuple[SchedulerConfig, Optional[int]]:
        """Connect every worker to rank 0's ordering channel (collective: the first init/broadcast)
        and return rank 0's ``settings`` and ``grain`` (None: rank 0 probes the link for it).

        Rank 0's address, settings and grain go through the store itself, as JSON under the
        reserved ``key`` (:func:`~bytescheduler.mxnet.keys.rank0_json`).
        """
        sent = None
        if self._rank == 0:
            host = local_address(os.environ.get("DMLC_PS_ROOT_URI"))
            sent = {"host": host, "port": channel.serve(self._num_workers, host=host),
                    "settings": shared_settings(settings), "grain": grain}
        found = self.call(lambda: rank0_json(self._inner, key, sent, _SETTINGS_BYTES),
                          "exchanging rank 0's ordering address")
        if self._rank == 0:
            channel.accept()
        else:
            channel.join((found["host"], found["port"]))
        return with_shared_settings(settings, found["settings"]), found["grain"]

    def launch(self, op: Operation, done: Done) -> None:
        try:
            self._kv.submit(lambda: self._launch_on_kv(op, done))
        except BaseException as exc:  # noqa: BLE001
            done(exc)

    def _launch_on_kv(self, op: Operation, done: Done) -> None:
        waits: _Waits = []
        try:
            for piece in op.pieces:
                job: Job = piece.task.payload
                waits.extend(self._issue(job, piece.start, piece.stop))
                job.mark_queued(piece.stop - piece.start)
        except BaseException as exc:  # noqa: BLE001
            for piece in op.pieces:
                piece.task.payload.fail(exc)
            done(exc)
            return
        self._waiters.put(waits, done)

    def _issue(self, job: Job, first: int, stop: int) -> _Waits:
        """Queue the inner store's call for sub-keys ``[first, stop)`` of the job's key;
        return what tells its completion."""
        info = job.info
        keys = info.subkeys[first:stop]
        values = info.groups(job.values, first, stop)
        outs = info.groups(job.outs, first, stop)
        if job.kind == "push":
            self._inner.push(*mx_args(keys, values), priority=job.priority)
            return [(view, True) for group in values for view in group]
        out_key, out = mx_args(keys, outs)
        if job.kind == "pull":
            self._inner.pull(out_key, out=out, priority=job.priority, ignore_sparse=job.ignore_sparse)
        else:
            self._inner.pushpull(*mx_args(keys, values), out=out, priority=job.priority)
        return [(view, False) for group in outs for view in group]

    def close(self, timeout: float) -> bool:
        """Stop the kv and waiter threads; False when one did not stop within ``timeout`` s each."""
        joined = self._kv.close(timeout)
        return self._waiters.close(timeout) and joined


class JobQueue:
    """Hands jobs to the scheduler: a key's next one once its previous one completed, a push
    once its arrays are computed (the ready thread); waits until they are queued."""

    def __init__(self, scheduler: Scheduler, rank: int, timeout: float) -> None:
        self._scheduler = scheduler
        self._rank = rank
        self.timeout = timeout
        self._lock = threading.Lock()
        self._ready: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run_ready, name=f"bytescheduler-ready-r{rank}", daemon=True)
        self._thread.start()

    def run(self, jobs: List[Job], wait: Callable[[Job], bool] = lambda job: True) -> None:
        """Submit every job (after its key's previous operation), then wait until the ones
        ``wait`` names are queued."""
        for job in jobs:
            self._enqueue(job)
        for job in jobs:
            if wait(job):
                self.wait_queued(job)

    def wait_queued(self, job: Job) -> None:
        """Wait until every piece of ``job`` is queued on the kv thread; raise its error."""
        if not job.queued.wait(self.timeout):
            self._scheduler.check()
            raise CommunicationTimeout(
                f"rank {self._rank}: the {job.kind} of key {job.info.key!r} could not start within "
                f"{self.timeout} s (it waits for the key's previous operation, which needs every "
                "worker); a peer may have died or stopped training")
        job.latch.raise_if_set()

    def wait_key(self, info: KeyInfo) -> None:
        """Wait until the last scheduled operation of ``info`` completed; raise its error."""
        if info.last is not None:
            self.wait_done(info.last)

    def wait_done(self, job: Job) -> None:
        """Wait until ``job`` completed; raise its error."""
        self.wait_queued(job)
        try:
            error = job.task.future.exception(self.timeout)
        except TimeoutError:
            raise CommunicationTimeout(
                f"rank {self._rank}: key {job.info.key!r} not communicated within {self.timeout} s; "
                "a peer may have died") from None
        if error is not None:
            reraise(error)

    def _enqueue(self, job: Job) -> None:
        info = job.info
        with self._lock:
            previous, info.last = info.last, job
        if previous is None or previous.task.future.done():
            self._submit(job, previous)
        else:
            previous.task.future.add_done_callback(lambda _f: self._submit(job, previous))

    def _submit(self, job: Job, previous: Optional[Job]) -> None:
        """Submit ``job`` once the previous operation of its key completed (via the ready thread
        when it pushes arrays: they may still be being computed)."""
        if previous is not None:
            error = previous.task.future.exception(0)
            if error is not None:
                self._fail(job, error)
                return
        if job.values:
            when_readable(job.values, lambda: self._computed(job))
        else:
            self._schedule(job)

    def _schedule(self, job: Job) -> None:
        try:
            future = self._scheduler.submit(job.task)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the job
            self._fail(job, exc)
            return
        future.add_done_callback(lambda f: f.exception(0) is not None and job.fail(f.exception(0)))

    @staticmethod
    def _fail(job: Job, error: BaseException) -> None:
        job.fail(error)
        job.task.future.set_exception(error)

    def _computed(self, job: Job) -> None:
        """The engine ran the job's read of its arrays (an engine thread): hand it over."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._ready.put(job)
        if closed:
            self._fail(job, CommunicationError("the ScheduledKVStore was closed"))

    def _run_ready(self) -> None:
        """Hand pushes to the scheduler as their arrays are computed, in that order.

        gluon's Trainer calls ``pushpull`` for every key right after ``backward()`` returns,
        long before MXNet's engine has computed the gradients. Scheduled at once, the first
        layers' keys (the most urgent, computed last) would go first and wait in the engine
        while nothing else moves, and no communication would overlap the backward pass. So a
        push waits until MXNet's engine tells (:func:`~bytescheduler.mxnet.engine.when_readable`)
        that its arrays are computed; this thread then hands it to the scheduler, after
        ``wait_to_read`` (at once for a computed array) has raised MXNet's error for a failed
        computation.
        """
        while True:
            job = self._ready.get()
            if job is None:
                return
            if self._closed:
                self._fail(job, CommunicationError("the ScheduledKVStore was closed"))
                continue
            try:
                for arr in job.values:
                    arr.wait_to_read()
            except BaseException as exc:  # noqa: BLE001 - MXNet reports a failed computation here
                self._fail(job, exc)
                continue
            self._schedule(job)

    def close(self, timeout: float) -> bool:
        """Fail the pushes still waiting for their arrays and stop the ready thread; False when
        it did not stop within ``timeout`` s."""
        with self._lock:
            self._closed = True
            self._ready.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
