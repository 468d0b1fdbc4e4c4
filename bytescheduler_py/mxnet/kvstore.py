"""``ScheduledKVStore``: priority scheduling and partitioning for MXNet's parameter server.

    import mxnet as mx
    from bytescheduler.mxnet.kvstore import ScheduledKVStore

    kv = ScheduledKVStore("dist_sync", partition_bytes="4MB", credit_bytes="16MB", timeout=300)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore=kv, update_on_kvstore=True)
    kv.overlap(net)          # optional: let the next forward start before every pull is queued
    ... train ...
    kv.close()               # or leave it to interpreter exit

On a ``dist_*`` store every ``pushpull`` becomes a :class:`~bytescheduler.core.task.Task` of the
core :class:`~bytescheduler.core.scheduler.Scheduler`: priority ``-priority`` (MXNet: higher goes
sooner; the Trainer passes ``-i``, so the first layers go first), split into element ranges of at
most ``partition_bytes``. A key larger than that is stored on the servers as *sub-keys*, one per
range (ints ``SUBKEY_BASE + n`` for int keys, ``"<key>#bs<j>"`` for str keys), initialised
collectively when the key is ``init``-ed or ``broadcast``. ``local`` and ``device`` stores are
passed straight through.

Threads: every call on the inner store is made by one "kv thread" (MXNet's kvstore is not thread
safe); a "waiter" thread learns completion through ``wait_to_read`` and tells the scheduler.
Generations of one key are serialised: the next ``pushpull`` of a key is submitted only when the
previous one completed (the dist store's push buffers must not be shared by two operations).

When does a call return? MXNet's engine orders operations by the time they are *queued*, so a
forward (or an optimizer update) queued before the kv thread queued the pull would read the old
array. Hence ``pushpull`` waits until all its pulls have been queued on the kv thread (not until
they completed), unless every output array belongs to a parameter registered with
:meth:`ScheduledKVStore.overlap`: then it returns at once and the forward pre-hooks of the blocks
wait instead, so communication of the last layers overlaps the forward of the first ones.
``push``, ``pull``, ``init`` and ``broadcast`` wait for earlier scheduled operations on the same
key, then run (partitioned) on the kv thread; they return once queued, as MXNet's do.

Limitations: push and pull outside ``pushpull`` are not scheduled (only partitioned); sparse
arrays, ``row_sparse_pull`` and gradient compression on partitioned keys are not supported;
per-tensor-norm optimizers (LARS, LAMB) are refused on the servers when keys are partitioned.
"""

from __future__ import annotations

import atexit
import copy
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, List, Optional, Tuple

import mxnet as mx
import numpy as np

from ..core.config import SchedulerConfig
from ..core.errors import ByteSchedulerError, CommunicationError, CommunicationTimeout
from ..core.partition import partition_ranges
from ..core.scheduler import Scheduler
from ..core.task import Operation, Task

__all__ = ["ScheduledKVStore", "SUBKEY_BASE", "KNOWN_TYPES"]

log = logging.getLogger("bytescheduler.mxnet")

# Int sub-keys start here; user int keys must stay below. ps-lite maps a key to a server with
# ``key * 9973`` in a 32-bit int, so keys must stay below about 215,000.
SUBKEY_BASE = 100_000
_MAX_INT_KEY = (2**31 - 1) // 9973

KNOWN_TYPES = frozenset({
    "local", "device", "nccl", "local_update_cpu", "local_allreduce_cpu", "local_allreduce_device",
    "dist", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device", "dist_device_sync",
    "dist_device_async", "p3", "dist_sync_p3", "dist_async_p3",
})

_NORM_OPTIMIZERS = ("lars", "lamb")


def _as_list(value) -> List[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _flat(arr, start: int, stop: int):
    """A view of the elements ``[start, stop)`` of ``arr`` (reshape and axis-0 slices are views)."""
    flat = arr.reshape(-1)
    if start == 0 and stop == flat.shape[0]:
        return flat
    return flat[start:stop]


class _KVThread:
    """Runs callables one at a time on a single thread (every call on the inner store)."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.Queue[Optional[Tuple[Callable[[], Any], Future]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if threading.current_thread() is self._thread:  # re-entrant: run inline
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001
                future.set_exception(exc)
            return future
        if self._closed:
            raise ByteSchedulerError("the ScheduledKVStore was closed")
        self._queue.put((fn, future))
        return future

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise CommunicationTimeout(
                f"{what} did not finish within {timeout} s on the kvstore thread; a peer may have "
                "died (set timeout= or BYTESCHEDULER_TIMEOUT to change the limit)") from None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                future.set_exception(exc)

    def close(self, timeout: float) -> bool:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _KeyInfo:
    """What the wrapper knows about one user key."""

    __slots__ = ("key", "index", "shape", "dtype", "numel", "itemsize", "ranges", "subkeys", "last")

    def __init__(self, key, index: int, shape, dtype, ranges, subkeys) -> None:
        self.key = key
        self.index = index  # the core Task key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.numel = int(np.prod(self.shape)) if self.shape else 1
        self.itemsize = self.dtype.itemsize
        self.ranges: List[Tuple[int, int]] = ranges
        self.subkeys: Dict[int, Any] = subkeys  # range start -> store key
        self.last: Optional["_Job"] = None

    @property
    def partitioned(self) -> bool:
        return len(self.ranges) > 1


class _Job:
    """One scheduled pushpull of one key."""

    __slots__ = ("info", "values", "outs", "priority", "task", "queued", "to_queue", "error", "lock")

    def __init__(self, info: _KeyInfo, values, outs, priority: int) -> None:
        self.info = info
        self.values = values
        self.outs = outs
        self.priority = priority
        self.task: Optional[Task] = None
        self.queued = threading.Event()  # every piece's pushpull is queued on the kv thread
        self.to_queue = len(info.ranges)
        self.error: Optional[BaseException] = None
        self.lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.queued.set()


class ScheduledKVStore(mx.kvstore.KVStoreBase):
    """Wraps an MXNet KVStore (or creates one from a type string); see the module docstring.

    Args:
        store: an ``mx.kv.KVStore`` or a store type string such as ``"dist_sync"``.
        partition_bytes, credit_bytes, timeout: scheduler options (None: environment or
            default, see :class:`~bytescheduler.core.config.SchedulerConfig`).
    """

    def __init__(self, store="dist_sync", partition_bytes=None, credit_bytes=None, timeout=None) -> None:
        if isinstance(store, str):
            name = store.lower()
            registered = {k.lower() for k in getattr(mx.kvstore.KVStoreBase, "kv_registry", {})}
            if name not in KNOWN_TYPES and name not in registered:
                raise ValueError(
                    f"unknown kvstore type {store!r} (mx.kv.create would silently return a local "
                    f"store); use one of {sorted(KNOWN_TYPES | registered)}")
            inner = mx.kv.create(store)
            if ("dist" in name) != ("dist" in inner.type):
                raise ValueError(f"asked for a {store!r} store but MXNet created {inner.type!r}")
        elif isinstance(store, mx.kvstore.KVStoreBase):
            if isinstance(store, ScheduledKVStore):
                raise TypeError("the store is already a ScheduledKVStore")
            inner = store
        else:
            raise TypeError(f"store must be an MXNet KVStore or a type string, not {type(store).__name__}")
        self._inner = inner
        self._type = inner.type
        self._scheduled = "dist" in self._type
        self._config = SchedulerConfig.resolve(partition_bytes=partition_bytes, credit_bytes=credit_bytes,
                                               timeout=timeout, merge=False)
        self._closed = False
        self._close_lock = threading.Lock()
        self._keys: Dict[Any, _KeyInfo] = {}
        self._key_kind: Optional[type] = None
        self._next_subkey = SUBKEY_BASE
        self._latest: Dict[int, Tuple[Any, _Job]] = {}  # id(out array) -> (array, job)
        self._lock = threading.Lock()
        self._overlap_params: List[Any] = []
        self._overlap_ids: set = set()
        self._optimizer = None
        self._optimizer_sent = False
        if not self._scheduled:
            return
        self._rank = inner.rank
        self._num_workers = inner.num_workers
        self._kv = _KVThread(f"bytescheduler-kv-r{self._rank}")
        self._waits: "queue.Queue[Optional[Tuple[list, Callable]]]" = queue.Queue()
        self._waiter = threading.Thread(target=self._run_waiter, name=f"bytescheduler-wait-r{self._rank}",
                                        daemon=True)
        self._waiter.start()
        self._scheduler = Scheduler(self, rank=self._rank, config=self._config)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    # ------------------------------------------------------------------ properties

    @property
    def inner(self):
        """The wrapped MXNet store."""
        return self._inner

    @property
    def type(self) -> str:
        return self._type

    @property
    def rank(self) -> int:
        return self._rank if self._scheduled else self._inner.rank

    @property
    def num_workers(self) -> int:
        return self._num_workers if self._scheduled else self._inner.num_workers

    @property
    def scheduler(self) -> Optional[Scheduler]:
        return self._scheduler if self._scheduled else None

    def is_capable(self, capability: str) -> bool:
        return self._inner.is_capable(capability)

    # ------------------------------------------------------------------ helpers

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        self._check_open()
        return self._kv.call(fn, self._config.timeout, what)

    def _check_open(self) -> None:
        if self._closed:
            raise ByteSchedulerError("the ScheduledKVStore was closed")

    def _check_key(self, key) -> None:
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer, str)):
            raise TypeError(f"kvstore keys are int or str, not {type(key).__name__} ({key!r})")
        kind = str if isinstance(key, str) else int
        if self._key_kind is None:
            self._key_kind = kind
        elif kind is not self._key_kind:
            raise TypeError(f"key {key!r} is {kind.__name__} but this store already uses "
                            f"{self._key_kind.__name__} keys; MXNet cannot mix int and str keys")
        if kind is int and not 0 <= int(key) < SUBKEY_BASE:
            raise ValueError(f"int key {key} out of range: ScheduledKVStore needs int keys in "
                             f"[0, {SUBKEY_BASE}) (sub-keys of partitioned tensors use the keys above)")

    def _info(self, key) -> _KeyInfo:
        self._check_key(key)
        info = self._keys.get(int(key) if not isinstance(key, str) else key)
        if info is None:
            raise KeyError(f"key {key!r} was not initialised: call init(key, value) or broadcast first")
        return info

    @staticmethod
    def _pairs(key, value) -> List[Tuple[Any, Any]]:
        """Split a key list into (key, value) pairs (value: NDArray or list of NDArrays)."""
        if isinstance(key, (list, tuple)):
            values = _as_list(value)
            if len(values) != len(key):
                raise ValueError(f"{len(key)} keys but {len(values)} values")
            return list(zip(key, values))
        return [(key, value)]

    def _check_shapes(self, info: _KeyInfo, arrays, what: str) -> None:
        for arr in arrays:
            if not isinstance(arr, mx.nd.NDArray):
                raise TypeError(f"{what} for key {info.key!r} must be an NDArray, not {type(arr).__name__}")
            if tuple(arr.shape) != info.shape:
                raise ValueError(f"{what} for key {info.key!r} has shape {tuple(arr.shape)} but the key "
                                 f"was initialised with shape {info.shape}")
            if np.dtype(arr.dtype) != info.dtype:
                raise ValueError(f"{what} for key {info.key!r} has dtype {np.dtype(arr.dtype)} but the key "
                                 f"was initialised with dtype {info.dtype}")
            if arr.stype != "default":
                raise NotImplementedError("ScheduledKVStore supports dense arrays only")

    def _wait_key(self, info: _KeyInfo) -> None:
        """Wait until the last scheduled operation of ``info`` completed."""
        job = info.last
        if job is None:
            return
        self._wait_queued(job)
        try:
            job.task.future.result(self._config.timeout)
        except TimeoutError:
            raise CommunicationTimeout(
                f"rank {self.rank}: key {info.key!r} not communicated within {self._config.timeout} s; "
                "a peer may have died") from None

    def _wait_queued(self, job: _Job) -> None:
        if not job.queued.wait(self._config.timeout):
            self._scheduler.check()
            raise CommunicationTimeout(
                f"rank {self.rank}: the pull of key {job.info.key!r} was not started within "
                f"{self._config.timeout} s; is a peer dead or not training?")
        if job.error is not None:
            error = job.error
            raise type(error)(str(error)) from error

    # ------------------------------------------------------------------ init / broadcast

    def _register(self, key, value) -> _KeyInfo:
        """Record a new key and allocate its sub-keys (same order on every worker)."""
        self._check_key(key)
        key = key if isinstance(key, str) else int(key)
        if key in self._keys:
            raise ValueError(f"key {key!r} was already initialised")
        if not isinstance(value, mx.nd.NDArray):
            raise TypeError(f"value for key {key!r} must be an NDArray, not {type(value).__name__}")
        if value.stype != "default":
            raise NotImplementedError("ScheduledKVStore supports dense arrays only")
        numel = int(np.prod(value.shape)) if value.shape else 1
        itemsize = np.dtype(value.dtype).itemsize
        ranges = partition_ranges(numel, itemsize, self._config.partition_bytes) or [(0, numel)]
        if len(ranges) == 1:
            subkeys = {0: key}
        elif isinstance(key, str):
            subkeys = {start: f"{key}#bs{j}" for j, (start, _) in enumerate(ranges)}
        else:
            subkeys = {}
            for start, _ in ranges:
                if self._next_subkey > _MAX_INT_KEY:
                    raise ValueError("too many partitions: raise partition_bytes")
                subkeys[start] = self._next_subkey
                self._next_subkey += 1
        info = _KeyInfo(key, len(self._keys), value.shape, value.dtype, ranges, subkeys)
        if info.partitioned and self._optimizer_sent:
            self._check_optimizer(self._optimizer, [info])
        self._keys[key] = info
        return info

    def init(self, key, value) -> None:
        if not self._scheduled:
            return self._inner.init(key, value)
        for k, v in self._pairs(key, value):
            info = self._register(k, _as_list(v)[0])
            self._call(lambda info=info, v=_as_list(v)[0]: self._init_on_kv(info, v), f"init({k!r})")
        self._maybe_resend_optimizer()

    def _init_on_kv(self, info: _KeyInfo, value) -> None:
        if not info.partitioned:
            self._inner.init(info.key, value)
            return
        for start, stop in info.ranges:
            self._inner.init(info.subkeys[start], _flat(value, start, stop))

    def broadcast(self, key, value, out, priority=0) -> None:
        if not self._scheduled:
            return self._inner.broadcast(key, value, out, priority)
        pairs = self._pairs(key, value)
        outs = self._pairs(key, out) if isinstance(key, (list, tuple)) else [(key, out)]
        for (k, v), (_, o) in zip(pairs, outs):
            v = _as_list(v)[0]
            info = self._register(k, v)
            o = _as_list(o)
            self._check_shapes(info, o, "out")

            def run(info=info, v=v, o=o):
                if not info.partitioned:
                    self._inner.broadcast(info.key, v, o, priority)
                    return
                self._init_on_kv(info, v)
                for start, stop in info.ranges:
                    self._inner.pull(info.subkeys[start], [_flat(x, start, stop) for x in o], priority)
            self._call(run, f"broadcast({k!r})")
        self._maybe_resend_optimizer()

    # ------------------------------------------------------------------ push / pull / pushpull

    def push(self, key, value, priority=0) -> None:
        if not self._scheduled:
            return self._inner.push(key, value, priority)
        for k, v in self._pairs(key, value):
            info = self._info(k)
            values = _as_list(v)
            self._check_shapes(info, values, "value")
            self._send_optimizer()
            self._wait_key(info)

            def run(info=info, values=values):
                for start, stop in info.ranges:
                    vals = [_flat(x, start, stop) for x in values]
                    self._inner.push(info.subkeys[start], vals if len(vals) > 1 else vals[0], priority)
            self._call(run, f"push({k!r})")

    def pull(self, key, out=None, priority=0, ignore_sparse=True) -> None:
        if not self._scheduled:
            return self._inner.pull(key, out=out, priority=priority, ignore_sparse=ignore_sparse)
        if out is None:
            raise ValueError("pull needs out=")
        for k, o in self._pairs(key, out):
            info = self._info(k)
            outs = _as_list(o)
            self._check_shapes(info, outs, "out")
            self._wait_key(info)

            def run(info=info, outs=outs):
                for start, stop in info.ranges:
                    views = [_flat(x, start, stop) for x in outs]
                    self._inner.pull(info.subkeys[start], views if len(views) > 1 else views[0],
                                     priority=priority, ignore_sparse=ignore_sparse)
            self._call(run, f"pull({k!r})")

    def pushpull(self, key, value, out=None, priority=0) -> None:
        if not self._scheduled:
            return self._inner.pushpull(key, value, out=out, priority=priority)
        self._check_open()
        self._scheduler.check()
        pairs = self._pairs(key, value)
        outs = [o for _, o in self._pairs(key, out)] if out is not None else [None] * len(pairs)
        self._send_optimizer()
        jobs = []
        for (k, v), o in zip(pairs, outs):
            info = self._info(k)
            values = _as_list(v)
            out_list = values if o is None else _as_list(o)
            self._check_shapes(info, values, "value")
            self._check_shapes(info, out_list, "out")
            job = _Job(info, values, out_list, priority)
            job.task = Task(info.index, info.numel, info.itemsize, -priority, job, name=f"key{info.key}")
            with self._lock:
                previous, info.last = info.last, job
                for arr in out_list:
                    self._latest[id(arr)] = (arr, job)
            if previous is None or previous.task.future.done():
                self._submit(job, previous)
            else:
                previous.task.future.add_done_callback(lambda _f, job=job, prev=previous: self._submit(job, prev))
            jobs.append(job)
        for job in jobs:
            if not self._covered(job.outs, job.values):
                self._wait_queued(job)

    def _submit(self, job: _Job, previous: Optional[_Job]) -> None:
        """Submit ``job`` once the previous generation of its key completed."""
        try:
            if previous is not None:
                error = previous.task.future.exception(0)
                if error is not None:
                    raise error
            future = self._scheduler.submit(job.task)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the job
            job.fail(exc)
            job.task.future.set_exception(exc)
            return
        future.add_done_callback(lambda f, job=job: f.exception(0) is not None and job.fail(f.exception(0)))

    # ------------------------------------------------------------------ the scheduler's backend

    def launch(self, op: Operation, done: Callable[[Optional[BaseException]], None]) -> None:
        try:
            self._kv.submit(lambda: self._launch_on_kv(op, done))
        except BaseException as exc:  # noqa: BLE001
            done(exc)

    def _launch_on_kv(self, op: Operation, done) -> None:
        waits = []
        try:
            for piece in op.pieces:
                job: _Job = piece.task.payload
                info = job.info
                start, stop = piece.start, piece.stop
                subkey = info.subkeys.get(start)
                if subkey is None or (info.partitioned and (start, stop) not in info.ranges):
                    raise ByteSchedulerError(f"piece [{start}, {stop}) of key {info.key!r} does not match "
                                             f"its sub-keys {info.ranges}")
                vals = [_flat(x, start, stop) for x in job.values]
                outs = [_flat(x, start, stop) for x in job.outs]
                self._inner.pushpull(subkey, vals if len(vals) > 1 else vals[0],
                                     out=outs if len(outs) > 1 else outs[0], priority=job.priority)
                waits.extend(outs)
                with job.lock:
                    job.to_queue -= 1
                    if job.to_queue == 0:
                        job.queued.set()
        except BaseException as exc:  # noqa: BLE001
            for piece in op.pieces:
                piece.task.payload.fail(exc)
            done(exc)
            return
        self._waits.put((waits, done))

    def _run_waiter(self) -> None:
        while True:
            item = self._waits.get()
            if item is None:
                return
            arrays, done = item
            try:
                for arr in arrays:
                    arr.wait_to_read()
            except BaseException as exc:  # noqa: BLE001
                done(CommunicationError(f"rank {self._rank}: pushpull failed: {exc}"))
                continue
            done(None)

    # ------------------------------------------------------------------ optimizer

    def _check_optimizer(self, optimizer, infos) -> None:
        if optimizer is None:
            return
        if type(optimizer).__name__.lower() in _NORM_OPTIMIZERS and any(i.partitioned for i in infos):
            raise ValueError(
                f"{type(optimizer).__name__} computes per-tensor norms, which would be wrong on the "
                "servers for a tensor split into pieces; raise partition_bytes above the largest "
                "parameter, or use update_on_kvstore=False")

    def set_optimizer(self, optimizer) -> None:
        if not self._scheduled:
            return self._inner.set_optimizer(optimizer)
        self._check_open()
        self._check_optimizer(optimizer, self._keys.values())
        # Sent at the first push/pushpull, when the sub-keys of every key are known.
        self._optimizer = optimizer
        self._optimizer_sent = False
        if self._keys:
            self._send_optimizer()

    def _server_optimizer(self, optimizer):
        """A copy whose multipliers cover every sub-key as they cover the parent key on a server."""
        server = copy.copy(optimizer)
        server.lr_mult = dict(optimizer.lr_mult)
        server.wd_mult = dict(optimizer.wd_mult)
        server.idx2name = dict(optimizer.idx2name)
        for info in self._keys.values():
            # Exactly what a server sees for the parent key: gluon's param_dict is not pickled,
            # so (as without bytescheduler) only lr_mult, wd_mult and idx2name reach it.
            for sub in info.subkeys.values():
                if info.key in optimizer.lr_mult:
                    server.lr_mult[sub] = optimizer.lr_mult[info.key]
                if info.key in optimizer.wd_mult:
                    server.wd_mult[sub] = optimizer.wd_mult[info.key]
                if info.key in optimizer.idx2name:
                    server.idx2name[sub] = optimizer.idx2name[info.key]
        return server

    def _send_optimizer(self) -> None:
        if self._optimizer is None or self._optimizer_sent:
            return
        self._check_optimizer(self._optimizer, self._keys.values())
        server = self._server_optimizer(self._optimizer)
        self._call(lambda: self._inner.set_optimizer(server), "set_optimizer")
        self._optimizer_sent = True

    def _maybe_resend_optimizer(self) -> None:
        if self._optimizer_sent and any(i.partitioned for i in self._keys.values()):
            log.warning("a partitioned key was initialised after the optimizer was sent; sending it "
                        "again (the servers' optimizer states are reset)")
            self._optimizer_sent = False
            self._send_optimizer()

    def set_gradient_compression(self, compression_params) -> None:
        if not self._scheduled:
            return self._inner.set_gradient_compression(compression_params)
        self._call(lambda: self._inner.set_gradient_compression(compression_params), "set_gradient_compression")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        if not self._scheduled:
            return self._inner.save_optimizer_states(fname, dump_optimizer)
        self.synchronize()
        return self._call(lambda: self._inner.save_optimizer_states(fname, dump_optimizer), "save_optimizer_states")

    def load_optimizer_states(self, fname):
        if not self._scheduled:
            return self._inner.load_optimizer_states(fname)
        self.synchronize()
        return self._call(lambda: self._inner.load_optimizer_states(fname), "load_optimizer_states")

    def _barrier(self) -> None:
        if not self._scheduled:
            return self._inner._barrier()
        self.synchronize()
        self._call(self._inner._barrier, "_barrier")

    # ------------------------------------------------------------------ overlap with forward

    def overlap(self, net) -> List[Any]:
        """Let the next forward start while the last pulls are still being queued.

        Registers a forward pre-hook on ``net`` and every child block that waits until the
        pulls of the block's own parameters (of the last ``pushpull``) have been queued on the
        kv thread; ``pushpull`` into these parameters then returns at once. A hybridized block
        runs as one graph, and MXNet only calls the hook of the outermost hybridized block:
        that hook waits for all parameters under it (no overlap inside it).
        Returns the hook handles (``handle.detach()`` removes one).
        """
        handles = []
        blocks = []

        def walk(block):
            blocks.append(block)
            for child in block._children.values():
                walk(child() if isinstance(child, weakref.ref) else child)
        walk(net)
        for block in blocks:
            own = list(getattr(block, "_reg_params", {}).values())
            every = list(block.collect_params().values())
            self._overlap_params.extend(own)
            handles.append(block.register_forward_pre_hook(
                lambda blk, _inputs, own=own, every=every: self._wait_params(
                    every if getattr(blk, "_active", False) else own)))
        self._overlap_ids.clear()
        return handles

    def _wait_params(self, params) -> None:
        jobs = []
        with self._lock:
            for param in params:
                for arr in (param._data or []):
                    entry = self._latest.get(id(arr))
                    if entry is not None and entry[0] is arr:
                        jobs.append(entry[1])
        for job in jobs:
            self._wait_queued(job)

    def _covered(self, outs, values) -> bool:
        """True when every output belongs to a parameter whose blocks wait for it (overlap)."""
        if not self._overlap_params or any(o is v for o in outs for v in values):
            return False
        if not all(id(o) in self._overlap_ids for o in outs):
            self._overlap_ids = {id(arr) for p in self._overlap_params for arr in (p._data or [])}
        return all(id(o) in self._overlap_ids for o in outs)

    # ------------------------------------------------------------------ end

    def synchronize(self) -> None:
        """Wait until every scheduled operation completed (e.g. before reading the weights)."""
        if not self._scheduled:
            return
        for info in list(self._keys.values()):
            self._wait_key(info)
        self._scheduler.flush()

    def close(self, wait: bool = True) -> None:
        """Finish (``wait=True``) or abandon scheduled work and join the threads; idempotent."""
        with self._close_lock:
            if self._closed or not self._scheduled:
                self._closed = True
                return
            self._closed = True
        error = None
        try:
            if wait:
                for info in list(self._keys.values()):
                    try:
                        self._wait_key(info)
                    except BaseException as exc:  # noqa: BLE001
                        error = error or exc
                        wait = False
                        break
            try:
                self._scheduler.stop(wait=wait)
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        finally:
            self._waits.put(None)
            joined = self._kv.close(5.0 if error is None else 1.0)
            self._waiter.join(5.0 if error is None else 1.0)
            if not joined or self._waiter.is_alive():
                log.warning("ScheduledKVStore threads did not stop (a peer may have died)")
        if error is not None:
            raise error

    def __enter__(self) -> "ScheduledKVStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)
