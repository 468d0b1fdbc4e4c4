"""``ScheduledKVStore``: priority scheduling and partitioning for MXNet's parameter server.

    import mxnet as mx
    from bytescheduler.mxnet.kvstore import ScheduledKVStore

    kv = ScheduledKVStore("dist_sync", partition_bytes="4MB", credit_bytes="16MB", timeout=300)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore=kv, update_on_kvstore=True)
    kv.overlap(net)                  # optional: the next forward starts before every pull is queued
    ... train ...
    kv.set_partition_bytes("8MB")    # at any time, e.g. between steps (a tuner)
    ... train ...
    kv.close()                       # or leave it to interpreter exit

On a ``dist_*`` store every ``pushpull``, ``push`` and ``pull`` becomes a
:class:`~bytescheduler.core.task.Task` of the core :class:`~bytescheduler.core.scheduler.Scheduler`:
priority ``-priority`` (MXNet: higher goes sooner; the Trainer passes ``-i``, so the first layers
go first), cut into pieces of about ``partition_bytes`` and admitted under ``credit_bytes``. A
push enters the scheduler when its arrays are computed (see ``_run_ready``), so communication
overlaps the backward pass.
``local`` and ``device`` stores are passed straight through.

One order on every worker. Pushes enter the scheduler as their gradients are computed, at
slightly different moments on each worker. Were every worker to pick its own pieces under the
credit, two workers could fill it with different pieces, each waiting on the servers for the
other's push of it: a deadlock. So rank 0 decides, as in the torch adapters: its decisions go to
the other workers over a TCP connection (:class:`~bytescheduler.core.tcp_channel.TcpOrderChannel`),
set up at the first ``init`` or ``broadcast`` (rank 0's address travels through the store, under
a reserved key), and every worker issues exactly those pieces in that order.

Server grain. A key larger than ``grain_bytes`` lives on the servers as *sub-keys* of at most
``grain_bytes`` each (ints ``SUBKEY_BASE + n`` for int keys, ``"<key>#bs<j>"`` for str keys),
initialised collectively when the key is ``init``-ed or ``broadcast``. The grain is fixed for the
run: the servers keep state per key (the value and, with ``update_on_kvstore``, the optimizer's
momentum), which new keys would start without. The scheduler sees such a key as a tensor with one
element per sub-key, so every piece it cuts is a run of whole sub-keys, sent with one
list-of-keys call. Changing the partition size (:meth:`ScheduledKVStore.set_partition_bytes`)
therefore only regroups sub-keys and never touches server state; sizes below the grain are
refused. The default grain is the initial ``partition_bytes``: each sub-key costs the servers a
request and an optimizer call per step, so smaller grains are slower (1 MiB instead of 4 MiB
made VGG-like training 28% slower at 1 Gbit/s).

Threads: every call on the inner store is made by one "kv thread" (MXNet's kvstore is not thread
safe); a "waiter" thread learns completion through ``wait_to_read`` (``wait_to_write`` for a
push) and tells the scheduler.

Order within a key: the next operation of a key is submitted to the scheduler only once the
previous one completed. Two pushes of one worker in flight for one key break the server's count
(it counts pushes, not workers), and a pull still in flight when the key's next push goes out
(e.g. the pull of ``broadcast``, which gluon's Trainer does in the same ``step`` as the first
push) may be answered with the next merged value: with ``update_on_kvstore=False`` unwrapped
MXNet then sets the weights to the gradient sum (see docs/mxnet.md).

When does a call return? MXNet's engine orders operations by the time they are *queued*, so a
forward (or an optimizer update, or a refill of a pushed array) queued before the kv thread
queued our call would run on the wrong data. Hence every call returns once all its pieces have
been queued on the kv thread (not completed), which includes waiting for the key's previous
operation. One exception: a ``pushpull`` whose outputs all belong to parameters registered with
:meth:`ScheduledKVStore.overlap` returns at once, and the forward pre-hooks of the blocks wait
instead, so communication of the last layers overlaps the forward of the first ones. As a
consequence, every worker must push a key before any worker waits to pull it (true of every
data-parallel loop; ``init`` and ``broadcast`` are collective as in MXNet).

Limitations: sparse arrays, ``row_sparse_pull`` and gradient compression on partitioned keys are
not supported; per-tensor-norm optimizers (LARS, LAMB) are refused on the servers when keys are
partitioned.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np

from ..core.config import SchedulerConfig, Size, parse_size
from ..core.errors import ByteSchedulerError, CommunicationError, CommunicationTimeout, ErrorLatch, reraise
from ..core.partition import partition_ranges
from ..core.scheduler import Scheduler
from ..core.tcp_channel import TcpOrderChannel, local_address
from ..core.task import Operation, Task

__all__ = ["ScheduledKVStore", "SUBKEY_BASE", "KNOWN_TYPES", "KVSTORE_DEFAULTS"]

log = logging.getLogger("bytescheduler.mxnet")

# Int sub-keys start here; user int keys must stay below. ps-lite maps a key to a server with
# ``key * 9973`` in a 32-bit int, so keys must stay below about 215,000.
SUBKEY_BASE = 100_000
_MAX_INT_KEY = (2**31 - 1) // 9973
# A push+pull holds its credit until the servers heard from every worker, so the parameter
# server needs a larger credit than an all-reduce to keep the link busy: 64 MiB measured 1.04x
# of dist_sync at 1 Gbit/s and 1.00x at 2 Gbit/s, against 1.02x and 0.93x with 16 MiB.
KVSTORE_DEFAULTS = SchedulerConfig(credit_bytes=64 * 1024**2)
# Reserved keys that carry rank 0's ordering address (int or str, as the user's keys).
_ORDER_KEY_INT = _MAX_INT_KEY
_ORDER_KEY_STR = "__bytescheduler_order__"

# How long the ready thread gathers a burst of pushes before choosing which to wait for first.
_BURST_SECONDS = 0.001

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


def _wait_to_write(arr) -> None:
    """Wait until every operation queued on ``arr`` finished, reads included (a push reads).

    MXNet's Python API has only ``wait_to_read``, which does not wait for reads.
    """
    mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(arr.handle))


def _mx_args(keys: Sequence[Any], arrays: List[List[Any]]) -> Tuple[Any, Any]:
    """MXNet's argument form: one key and its array(s), or a list of keys and one entry per key."""
    entries = [group[0] if len(group) == 1 else group for group in arrays]
    if len(keys) == 1:
        return keys[0], entries[0]
    return list(keys), entries


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
    """What the wrapper knows about one user key: its shape and its sub-keys on the servers."""

    __slots__ = ("key", "index", "shape", "dtype", "numel", "itemsize", "grains", "subkeys", "last")

    def __init__(self, key, index: int, shape, dtype, grains: List[Tuple[int, int]], subkeys: List[Any]) -> None:
        self.key = key
        self.index = index  # the core Task key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.numel = int(np.prod(self.shape)) if self.shape else 1
        self.itemsize = self.dtype.itemsize
        self.grains = grains  # element range of each sub-key, in order
        self.subkeys = subkeys  # the store key of each grain
        self.last: Optional["_Job"] = None

    @property
    def partitioned(self) -> bool:
        return len(self.grains) > 1

    def task(self, payload: "_Job", priority: float) -> Task:
        """The scheduler's view of the key: one element per sub-key (a piece is a run of them)."""
        first, stop = self.grains[0]
        return Task(self.index, len(self.grains), (stop - first) * self.itemsize, priority, payload,
                    name=f"key{self.key}")


class _Job:
    """One scheduled ``push``, ``pull`` or ``pushpull`` of one key."""

    __slots__ = ("kind", "info", "values", "outs", "priority", "ignore_sparse", "task", "queued",
                 "unqueued", "latch", "lock")

    def __init__(self, kind: str, info: _KeyInfo, values: List[Any], outs: List[Any], priority: int,
                 ignore_sparse: bool = True) -> None:
        self.kind = kind
        self.info = info
        self.values = values  # arrays pushed (push, pushpull)
        self.outs = outs  # arrays pulled into (pull, pushpull)
        self.priority = priority
        self.ignore_sparse = ignore_sparse
        self.task = info.task(self, -priority)
        self.queued = threading.Event()  # every piece's call is queued on the kv thread
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


class ScheduledKVStore(mx.kvstore.KVStoreBase):
    """Wraps an MXNet KVStore (or creates one from a type string); see the module docstring.

    Args:
        store: an ``mx.kv.KVStore`` or a store type string such as ``"dist_sync"``.
        partition_bytes, credit_bytes, timeout: scheduler options (None: environment or
            default, see :class:`~bytescheduler.core.config.SchedulerConfig`; the credit defaults
            to 64 MiB here, :data:`KVSTORE_DEFAULTS`); rank 0's count.
        grain_bytes: size of the sub-keys large keys are split into on the servers, and the
            smallest partition size allowed during the run (default ``partition_bytes``).
        auto_tune: tune partition (not below the grain) and credit online on rank 0 (see
            :class:`~bytescheduler.core.tuning.AutoTuner`); a step begins at each push of the
            first key registered (gluon pushes every key once per step).
    """

    def __init__(self, store="dist_sync", partition_bytes=None, credit_bytes=None, timeout=None,
                 grain_bytes=None, auto_tune=None) -> None:
        if isinstance(store, str):
            name = store.lower()
            registered = {k.lower() for k in getattr(mx.kvstore.KVStoreBase, "kv_registry", {})}
            if name not in KNOWN_TYPES and name not in registered:
                raise ValueError(
                    f"unknown kvstore type {store!r} (mx.kv.create would silently return a local "
                    f"store); use one of {sorted(KNOWN_TYPES | registered)}")
        elif isinstance(store, ScheduledKVStore):
            raise TypeError("the store is already a ScheduledKVStore")
        elif not isinstance(store, mx.kvstore.KVStoreBase):
            raise TypeError(f"store must be an MXNet KVStore or a type string, not {type(store).__name__}")
        config = SchedulerConfig.resolve(defaults=KVSTORE_DEFAULTS, partition_bytes=partition_bytes,
                                         credit_bytes=credit_bytes, timeout=timeout, merge=False,
                                         auto_tune=auto_tune)
        if grain_bytes is None:
            grain = config.partition_bytes
        else:
            grain = parse_size(grain_bytes, "grain_bytes")
            if grain > config.partition_bytes:
                raise ValueError(f"grain_bytes={grain} is larger than partition_bytes={config.partition_bytes}; "
                                 "a piece holds whole grains, so the grain must not exceed the partition size")
        if isinstance(store, str):
            inner = mx.kv.create(store)
            if ("dist" in name) != ("dist" in inner.type):
                raise ValueError(f"asked for a {store!r} store but MXNet created {inner.type!r}")
        else:
            inner = store
        self._inner = inner
        self._type = inner.type
        self._scheduled = "dist" in self._type
        self._config = config
        self._grain_bytes = grain
        self._partition_bytes = config.partition_bytes  # local stores only; dist ones ask the scheduler
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
        self._waits: "queue.Queue[Optional[Tuple[List[Tuple[Any, bool]], Callable]]]" = queue.Queue()
        self._waiter = threading.Thread(target=self._run_waiter, name=f"bytescheduler-wait-r{self._rank}",
                                        daemon=True)
        self._waiter.start()
        self._ready: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._ready_thread = threading.Thread(target=self._run_ready, name=f"bytescheduler-ready-r{self._rank}",
                                              daemon=True)
        self._ready_thread.start()
        self._channel = TcpOrderChannel(self._rank, config.timeout) if self._num_workers > 1 else None
        # A piece holds whole sub-keys: the tuner's search stays at or above the grain.
        self._scheduler = Scheduler(self, channel=self._channel, rank=self._rank, config=self._config,
                                    tuning={"min_partition_bytes": grain})
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

    @property
    def partition_bytes(self) -> int:
        """The current size of the scheduled pieces (see :meth:`set_partition_bytes`)."""
        return self._scheduler.config.partition_bytes if self._scheduled else self._partition_bytes

    @property
    def grain_bytes(self) -> int:
        """The size of the sub-keys on the servers, fixed for the run."""
        return self._grain_bytes

    def is_capable(self, capability: str) -> bool:
        return self._inner.is_capable(capability)

    def set_partition_bytes(self, partition_bytes: Size) -> int:
        """Change the size of the scheduled pieces from now on; return it in bytes.

        Call it at any time from the training thread, e.g. between steps when a tuner picks a
        new size. Operations submitted afterwards are cut at the new size; pieces already
        queued keep theirs. A piece is a run of whole sub-keys, so it holds
        ``partition_bytes // grain_bytes`` of them. The servers' keys and their state (values,
        optimizer momentum) stay as they are, so the math does not change, and the call is not
        collective: workers may even use different sizes.

        Raises ``ValueError`` below :attr:`grain_bytes`: smaller pieces would need new server
        keys, which would start without the old keys' state. Pass a smaller ``grain_bytes`` to
        the constructor to allow smaller pieces.

        >>> kv.set_partition_bytes("8MB")
        8000000
        """
        size = parse_size(partition_bytes, "partition_bytes")
        if size < self._grain_bytes:
            raise ValueError(
                f"partition_bytes={size} is below the server grain of {self._grain_bytes} bytes fixed "
                "when the store was created (smaller pieces would need new server keys, losing their "
                "optimizer state); create the ScheduledKVStore with a smaller grain_bytes")
        self._check_open()
        if self._scheduled:
            self._scheduler.reconfigure(partition_bytes=size)
        else:
            self._partition_bytes = size
        return size

    # ------------------------------------------------------------------ helpers

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        self._check_open()
        return self._kv.call(fn, self._config.timeout, what)

    def _check_open(self) -> None:
        if self._closed:
            raise ByteSchedulerError("the ScheduledKVStore was closed")

    def _check_keys(self, keys: Sequence[Any]) -> Optional[type]:
        """Check the keys' types and range (every key of a call, before anything is done).

        Returns their type (int or str), None for no keys.
        """
        kinds = set()
        for key in keys:
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer, str)):
                raise TypeError(f"kvstore keys are int or str, not {type(key).__name__} ({key!r})")
            kind = str if isinstance(key, str) else int
            if kind is int and not 0 <= int(key) < SUBKEY_BASE:
                raise ValueError(f"int key {key} out of range: ScheduledKVStore needs int keys in "
                                 f"[0, {SUBKEY_BASE}) (sub-keys of partitioned tensors use the keys above)")
            kinds.add(kind)
        known = {self._key_kind} if self._key_kind is not None else set()
        if len(kinds | known) > 1:
            used = f"this store already uses {self._key_kind.__name__} keys" if known else "the keys differ"
            raise TypeError(f"keys {list(keys)!r} mix int and str ({used}); MXNet cannot mix int and str keys")
        return kinds.pop() if kinds else None

    def _info(self, key) -> _KeyInfo:
        self._check_keys([key])
        info = self._keys.get(key if isinstance(key, str) else int(key))
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

    @staticmethod
    def _check_arrays(key, arrays, shape, dtype, what: str) -> None:
        for arr in arrays:
            if not isinstance(arr, mx.nd.NDArray):
                raise TypeError(f"{what} for key {key!r} must be an NDArray, not {type(arr).__name__}")
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{what} for key {key!r} has shape {tuple(arr.shape)} but the key "
                                 f"was initialised with shape {tuple(shape)}")
            if np.dtype(arr.dtype) != np.dtype(dtype):
                raise ValueError(f"{what} for key {key!r} has dtype {np.dtype(arr.dtype)} but the key "
                                 f"was initialised with dtype {np.dtype(dtype)}")
            if arr.stype != "default":
                raise NotImplementedError("ScheduledKVStore supports dense arrays only")

    def _check_shapes(self, info: _KeyInfo, arrays, what: str) -> None:
        self._check_arrays(info.key, arrays, info.shape, info.dtype, what)

    def _wait_key(self, info: _KeyInfo) -> None:
        """Wait until the last scheduled operation of ``info`` completed."""
        job = info.last
        if job is None:
            return
        self._wait_queued(job)
        try:
            error = job.task.future.exception(self._config.timeout)
        except TimeoutError:
            raise CommunicationTimeout(
                f"rank {self.rank}: key {info.key!r} not communicated within {self._config.timeout} s; "
                "a peer may have died") from None
        if error is not None:
            reraise(error)

    def _wait_queued(self, job: _Job) -> None:
        if not job.queued.wait(self._config.timeout):
            self._scheduler.check()
            raise CommunicationTimeout(
                f"rank {self.rank}: the {job.kind} of key {job.info.key!r} could not start within "
                f"{self._config.timeout} s (it waits for the key's previous operation, which needs every "
                "worker); a peer may have died or stopped training")
        job.latch.raise_if_set()

    # ------------------------------------------------------------------ init / broadcast

    def _register(self, pairs: List[Tuple[Any, Any]]) -> List[_KeyInfo]:
        """Check every new (key, value) of a call, then record them all with their sub-keys.

        Nothing is recorded when one is wrong. On a dist store this is collective, like
        ``init``: every worker registers the same keys in the same order, so they allocate the
        same sub-keys.
        """
        kind = self._check_keys([key for key, _ in pairs])
        keys = [key if isinstance(key, str) else int(key) for key, _ in pairs]
        for key, (_, value) in zip(keys, pairs):
            if key in self._keys or keys.count(key) > 1:
                raise ValueError(f"key {key!r} was already initialised" if key in self._keys
                                 else f"key {key!r} appears twice in one call")
            if not isinstance(value, mx.nd.NDArray):
                raise TypeError(f"value for key {key!r} must be an NDArray, not {type(value).__name__}")
            if value.stype != "default":
                raise NotImplementedError("ScheduledKVStore supports dense arrays only")
        infos = []
        for key, (_, value) in zip(keys, pairs):
            numel = int(np.prod(value.shape)) if value.shape else 1
            grains = partition_ranges(numel, np.dtype(value.dtype).itemsize, self._grain_bytes) or [(0, numel)]
            info = _KeyInfo(key, len(self._keys) + len(infos), value.shape, value.dtype, grains,
                            self._new_subkeys(key, len(grains)))
            if info.partitioned and self._optimizer_sent:
                self._check_optimizer(self._optimizer, [info])
            infos.append(info)
        self._key_kind = kind or self._key_kind
        for info in infos:
            self._keys[info.key] = info
        return infos

    def _new_subkeys(self, key, count: int) -> List[Any]:
        if count == 1:
            return [key]
        if isinstance(key, str):
            return [f"{key}#bs{j}" for j in range(count)]
        if self._next_subkey + count - 1 >= _ORDER_KEY_INT:
            raise ValueError(f"too many server sub-keys (int keys must stay below {_MAX_INT_KEY}); "
                             "raise grain_bytes")
        first, self._next_subkey = self._next_subkey, self._next_subkey + count
        return list(range(first, first + count))

    def _init_on_kv(self, infos: List[_KeyInfo], values: List[Any]) -> None:
        """Initialise the sub-keys on the servers (one collective MXNet call)."""
        keys, arrays = [], []
        for info, value in zip(infos, values):
            keys.extend(info.subkeys)
            arrays.extend([_flat(value, start, stop)] for start, stop in info.grains)
        self._inner.init(*_mx_args(keys, arrays))

    def _connect_channel(self) -> None:
        """Connect every worker to rank 0's ordering channel (collective: the first init/broadcast).

        Rank 0's address goes through the store itself, under a reserved key of the user's key
        type (MXNet cannot mix int and str keys).
        """
        channel = self._channel
        if channel is None or channel.connected:
            return
        key = _ORDER_KEY_STR if self._key_kind is str else _ORDER_KEY_INT
        words = [0] * 5
        if self._rank == 0:
            port = channel.serve(self._num_workers)
            host = local_address(os.environ.get("DMLC_PS_ROOT_URI"))
            words = [int(part) for part in host.split(".")] + [port]

        def exchange() -> List[int]:
            self._inner.init(key, mx.nd.array(words, dtype="float32"))
            found = mx.nd.zeros((5,), dtype="float32")
            self._inner.pull(key, out=found)
            return [int(x) for x in found.asnumpy()]

        found = self._call(exchange, "exchanging rank 0's ordering address")
        if self._rank == 0:
            channel.accept()
        else:
            channel.join((".".join(str(x) for x in found[:4]), found[4]))

    def init(self, key, value) -> None:
        if not self._scheduled:
            return self._inner.init(key, value)
        self._check_open()
        pairs = [(k, _as_list(v)[0]) for k, v in self._pairs(key, value)]
        infos = self._register(pairs)
        self._connect_channel()
        self._call(lambda: self._init_on_kv(infos, [v for _, v in pairs]), f"init({key!r})")
        self._maybe_resend_optimizer()

    def broadcast(self, key, value, out, priority=0) -> None:
        if not self._scheduled:
            return self._inner.broadcast(key, value, out, priority)
        self._check_open()
        pairs = [(k, _as_list(v)[0]) for k, v in self._pairs(key, value)]
        outs = [_as_list(o) for _, o in self._pairs(key, out)]
        for (k, v), o in zip(pairs, outs):
            self._check_arrays(k, o, v.shape, v.dtype, "out")
        infos = self._register(pairs)
        self._connect_channel()
        self._call(lambda: self._init_on_kv(infos, [v for _, v in pairs]), f"broadcast({key!r})")
        self._maybe_resend_optimizer()
        # The pull is an operation of the key: the key's first push waits until it completed.
        self._run_jobs([_Job("pull", info, [], o, priority) for info, o in zip(infos, outs)])

    # ------------------------------------------------------------------ push / pull / pushpull

    def push(self, key, value, priority=0) -> None:
        if not self._scheduled:
            return self._inner.push(key, value, priority)
        self._check_open()
        self._scheduler.check()
        jobs = []
        for k, v in self._pairs(key, value):
            info = self._info(k)
            values = _as_list(v)
            self._check_shapes(info, values, "value")
            jobs.append(_Job("push", info, values, [], priority))
        self._send_optimizer()
        self._run_jobs(jobs)

    def pull(self, key, out=None, priority=0, ignore_sparse=True) -> None:
        if not self._scheduled:
            return self._inner.pull(key, out=out, priority=priority, ignore_sparse=ignore_sparse)
        if out is None:
            raise ValueError("pull needs out=")
        self._check_open()
        self._scheduler.check()
        jobs = []
        for k, o in self._pairs(key, out):
            info = self._info(k)
            outs = _as_list(o)
            self._check_shapes(info, outs, "out")
            jobs.append(_Job("pull", info, [], outs, priority, ignore_sparse))
        self._run_jobs(jobs)

    def pushpull(self, key, value, out=None, priority=0) -> None:
        if not self._scheduled:
            return self._inner.pushpull(key, value, out=out, priority=priority)
        self._check_open()
        self._scheduler.check()
        pairs = self._pairs(key, value)
        outs = [o for _, o in self._pairs(key, out)] if out is not None else [None] * len(pairs)
        jobs = []
        for (k, v), o in zip(pairs, outs):
            info = self._info(k)
            values = _as_list(v)
            out_list = values if o is None else _as_list(o)
            self._check_shapes(info, values, "value")
            self._check_shapes(info, out_list, "out")
            jobs.append(_Job("pushpull", info, values, out_list, priority))
        self._send_optimizer()
        self._run_jobs(jobs, lambda job: not self._covered(job.outs, job.values))

    def _run_jobs(self, jobs: List[_Job], wait: Callable[[_Job], bool] = lambda job: True) -> None:
        """Submit every job (after its key's previous operation), then wait until they are queued."""
        if any(job.values and job.info.index == 0 for job in jobs):
            self._scheduler.step_boundary()  # a push of the first key: a training step begins
        for job in jobs:
            self._enqueue(job)
        for job in jobs:
            if wait(job):
                self._wait_queued(job)

    def _enqueue(self, job: _Job) -> None:
        info = job.info
        with self._lock:
            previous, info.last = info.last, job
            for arr in job.outs:
                self._latest[id(arr)] = (arr, job)
        if previous is None or previous.task.future.done():
            self._submit(job, previous)
        else:
            previous.task.future.add_done_callback(lambda _f: self._submit(job, previous))

    def _submit(self, job: _Job, previous: Optional[_Job]) -> None:
        """Submit ``job`` once the previous operation of its key completed (via the ready thread
        when it pushes arrays: they may still be being computed)."""
        if previous is not None:
            error = previous.task.future.exception(0)
            if error is not None:
                self._fail_job(job, error)
                return
        if job.values:
            self._ready.put(job)
        else:
            self._schedule(job)

    def _schedule(self, job: _Job) -> None:
        try:
            future = self._scheduler.submit(job.task)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the job
            self._fail_job(job, exc)
            return
        future.add_done_callback(lambda f: f.exception(0) is not None and job.fail(f.exception(0)))

    @staticmethod
    def _fail_job(job: _Job, error: BaseException) -> None:
        job.fail(error)
        job.task.future.set_exception(error)

    def _run_ready(self) -> None:
        """Hand pushes to the scheduler when their arrays are computed, least urgent first.

        gluon's Trainer calls ``pushpull`` for every key right after ``backward()`` returns,
        long before MXNet's engine has computed the gradients. Scheduled at once, the first
        layers' keys (the most urgent, computed last) would go first and wait in the engine
        while nothing else moves, and no communication would overlap the backward pass. So a
        push waits here until its arrays are computed. The backward pass computes the last
        layers first, so the least urgent key of a burst of calls is waited for first.
        """
        pending: List[_Job] = []
        while True:
            arrived: List[Optional[_Job]] = []
            if not pending:  # idle: block for the first push, then gather the rest of its burst
                arrived.append(self._ready.get())
            try:
                while arrived[-1:] != [None]:
                    arrived.append(self._ready.get(timeout=_BURST_SECONDS) if not pending else
                                   self._ready.get_nowait())
            except queue.Empty:
                pass
            if arrived[-1:] == [None]:  # closed
                for job in pending + arrived[:-1]:
                    self._fail_job(job, CommunicationError("the ScheduledKVStore was closed"))
                return
            pending.extend(arrived)
            pending.sort(key=lambda job: job.task.priority)
            job = pending.pop()
            try:
                for arr in job.values:
                    arr.wait_to_read()
            except BaseException as exc:  # noqa: BLE001 - MXNet reports a failed computation here
                self._fail_job(job, exc)
                continue
            self._schedule(job)

    # ------------------------------------------------------------------ the scheduler's backend

    def launch(self, op: Operation, done: Callable[[Optional[BaseException]], None]) -> None:
        try:
            self._kv.submit(lambda: self._launch_on_kv(op, done))
        except BaseException as exc:  # noqa: BLE001
            done(exc)

    def _launch_on_kv(self, op: Operation, done) -> None:
        waits: List[Tuple[Any, bool]] = []
        try:
            for piece in op.pieces:
                job: _Job = piece.task.payload
                waits.extend(self._issue(job, piece.start, piece.stop))
                job.mark_queued(piece.stop - piece.start)
        except BaseException as exc:  # noqa: BLE001
            for piece in op.pieces:
                piece.task.payload.fail(exc)
            done(exc)
            return
        self._waits.put((waits, done))

    def _issue(self, job: _Job, first: int, stop: int) -> List[Tuple[Any, bool]]:
        """Queue the inner store's call for sub-keys ``[first, stop)`` of the job's key.

        Returns what tells completion: ``(array, True)`` to wait for writable (a push reads
        it), ``(array, False)`` to wait for readable (a pull writes it).
        """
        info = job.info
        keys = info.subkeys[first:stop]
        ranges = info.grains[first:stop]
        values = [[_flat(x, start, end) for x in job.values] for start, end in ranges]
        outs = [[_flat(x, start, end) for x in job.outs] for start, end in ranges]
        if job.kind == "push":
            self._inner.push(*_mx_args(keys, values), priority=job.priority)
            return [(view, True) for group in values for view in group]
        out_key, out = _mx_args(keys, outs)
        if job.kind == "pull":
            self._inner.pull(out_key, out=out, priority=job.priority, ignore_sparse=job.ignore_sparse)
        else:
            self._inner.pushpull(*_mx_args(keys, values), out=out, priority=job.priority)
        return [(view, False) for group in outs for view in group]

    def _run_waiter(self) -> None:
        while True:
            item = self._waits.get()
            if item is None:
                return
            arrays, done = item
            try:
                for arr, write in arrays:
                    if write:
                        _wait_to_write(arr)
                    else:
                        arr.wait_to_read()
            except BaseException as exc:  # noqa: BLE001
                done(CommunicationError(f"rank {self._rank}: kvstore operation failed: {exc}"))
                continue
            done(None)

    # ------------------------------------------------------------------ optimizer

    def _check_optimizer(self, optimizer, infos) -> None:
        if optimizer is None:
            return
        if type(optimizer).__name__.lower() in _NORM_OPTIMIZERS and any(i.partitioned for i in infos):
            raise ValueError(
                f"{type(optimizer).__name__} computes per-tensor norms, which would be wrong on the "
                "servers for a tensor split into pieces; raise grain_bytes (and partition_bytes) above "
                "the largest parameter, or use update_on_kvstore=False")

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
            for sub in info.subkeys:
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
        latch = ErrorLatch()
        try:
            if wait:
                try:
                    for info in list(self._keys.values()):
                        self._wait_key(info)
                except BaseException as exc:  # noqa: BLE001
                    latch.set(exc)
                    wait = False
            try:
                self._scheduler.stop(wait=wait)
            except BaseException as exc:  # noqa: BLE001
                latch.set(exc)
        finally:
            if self._channel is not None:
                self._channel.close()
            self._ready.put(None)
            self._waits.put(None)
            timeout = 1.0 if latch else 5.0
            joined = self._kv.close(timeout)
            self._waiter.join(timeout)
            self._ready_thread.join(timeout)
            if not joined or self._waiter.is_alive() or self._ready_thread.is_alive():
                log.warning("ScheduledKVStore threads did not stop (a peer may have died)")
        latch.raise_if_set()

    def __enter__(self) -> "ScheduledKVStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)
