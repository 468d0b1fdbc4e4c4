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

``ScheduledKVStore(store, ...)`` decides at construction what the store is: a
:class:`DistKVStore` over a ``dist_*`` store, a :class:`PassThroughKVStore` over any other
(``local``, ``device``, ...). Both are ``ScheduledKVStore`` instances with the same API.

On a ``dist_*`` store every ``pushpull``, ``push`` and ``pull`` becomes a
:class:`~bytescheduler.core.task.Task` of the core :class:`~bytescheduler.core.scheduler.Scheduler`:
priority ``-priority`` (MXNet: higher goes sooner; the Trainer passes ``-i``, so the first layers
go first), cut into pieces of about ``partition_bytes`` and admitted under ``credit_bytes``. A
push enters the scheduler when its arrays are computed, so communication overlaps the backward
pass. Rank 0 decides the order and every worker follows it. ``local`` and ``device`` stores are
passed straight through.

When does a call return? Once all its pieces have been queued on the store's kv thread (not
completed), which includes waiting for the key's previous operation: MXNet's engine orders by
queue time, so whatever the caller queues next must come after our call. One exception: a
``pushpull`` whose outputs all belong to parameters registered with
:meth:`ScheduledKVStore.overlap` returns at once, and the forward pre-hooks of the blocks wait
instead. As a consequence, every worker must push a key before any worker waits to pull it (true
of every data-parallel loop; ``init`` and ``broadcast`` are collective as in MXNet).

This module is the facade. The work is done by :mod:`~bytescheduler.mxnet.keys` (user keys as
sub-keys of one grain on the servers), :mod:`~bytescheduler.mxnet.grain` (the grain, chosen at
the first ``init`` from a probe of the link unless given), :mod:`~bytescheduler.mxnet.backend`
(the threads that call the inner store, the order on every worker and within a key) and
:mod:`~bytescheduler.mxnet.overlap` (the forward pre-hooks).

Limitations: sparse arrays, ``row_sparse_pull`` and gradient compression on partitioned keys are
not supported; per-tensor-norm optimizers (LARS, LAMB) are refused on the servers when keys are
partitioned.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import mxnet as mx

from ..core.agreement import from_rank_0
from ..core.config import SchedulerConfig, Size, parse_bool, parse_size
from ..core.grain import server_grain_bytes
from ..core.errors import ByteSchedulerError, ErrorLatch
from ..core.modes import ModeDriver
from ..core.scheduler import Scheduler
from ..core.tcp_channel import TcpOrderChannel
from .engine_env import engine_hint
from .backend import Job, JobQueue, KVBackend
from .grain import COARSE_SERVERS, choose_grain, probe_rate
from .keys import SUBKEY_BASE, KeyInfo, KeyLayout, as_list, check_arrays, check_optimizer, key_pairs, rank0_json
from .overlap import ForwardOverlap
from .plain import StoreModes

__all__ = ["ScheduledKVStore", "SUBKEY_BASE", "KNOWN_TYPES", "KVSTORE_DEFAULTS", "num_servers", "store_defaults"]

log = logging.getLogger("bytescheduler.mxnet")

# A push+pull holds its credit until the servers heard from every worker, so the parameter
# server needs a larger credit than an all-reduce to keep the link busy (docs/mxnet.md).
# Rank 0 also times MXNet's own calls against the schedule and runs the faster (plain.py).
# The partition (and so the grain) follows the number of servers: server_grain_bytes, 4 MiB
# on 1-2 servers.
KVSTORE_DEFAULTS = SchedulerConfig(credit_bytes=64 * 1024**2, adaptive=True)


def num_servers(environ: Any = None) -> int:
    """The job's number of parameter servers, from ``DMLC_NUM_SERVER`` (ps-lite's launchers set
    it in every process); 1 when unset."""
    value = (os.environ if environ is None else environ).get("DMLC_NUM_SERVER", "").strip()
    if not value:
        return 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"DMLC_NUM_SERVER={value!r} is not a number of servers (a positive integer); "
                         "fix the job's launcher")
    return count


def store_defaults(servers: int) -> SchedulerConfig:
    """The store's defaults with ``servers`` servers: :data:`KVSTORE_DEFAULTS` and a partition
    (the grain, unless ``grain_bytes`` is given) of :func:`server_grain_bytes`."""
    return replace(KVSTORE_DEFAULTS, partition_bytes=server_grain_bytes(servers, KVSTORE_DEFAULTS.credit_bytes))

KNOWN_TYPES = frozenset({
    "local", "device", "nccl", "local_update_cpu", "local_allreduce_cpu", "local_allreduce_device",
    "dist", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device", "dist_device_sync",
    "dist_device_async", "p3", "dist_sync_p3", "dist_async_p3",
})


def _names_dist(store: Any) -> bool:
    """Whether ``store`` (an MXNet store or a type string) is a ``dist_*`` store."""
    return "dist" in str(getattr(store, "type", store)).lower()


def _check_kind(made: "ScheduledKVStore", store: Any) -> None:
    """Refuse a store of the other kind given to :class:`DistKVStore` or :class:`PassThroughKVStore` directly."""
    if _names_dist(store) != isinstance(made, DistKVStore):
        raise TypeError(f"{type(made).__name__} does not wrap a {'' if _names_dist(store) else 'non-'}dist store; "
                        "create it with ScheduledKVStore(store, ...), which picks the kind")


def _inner_store(store: Any) -> Any:
    """The MXNet store to wrap: ``store`` itself, or a new one of the type ``store`` names."""
    if isinstance(store, ScheduledKVStore):
        raise TypeError("the store is already a ScheduledKVStore")
    if isinstance(store, mx.kvstore.KVStoreBase):
        return store
    if not isinstance(store, str):
        raise TypeError(f"store must be an MXNet KVStore or a type string, not {type(store).__name__}")
    name = store.lower()
    registered = {k.lower() for k in getattr(mx.kvstore.KVStoreBase, "kv_registry", {})}
    if name not in KNOWN_TYPES and name not in registered:
        raise ValueError(
            f"unknown kvstore type {store!r} (mx.kv.create would silently return a local "
            f"store); use one of {sorted(KNOWN_TYPES | registered)}")
    inner = mx.kv.create(store)
    if ("dist" in name) != ("dist" in inner.type):
        raise ValueError(f"asked for a {store!r} store but MXNet created {inner.type!r}")
    return inner


def _settings(defaults: Callable[[], SchedulerConfig], grain_bytes: Optional[Size],
              config: Optional[SchedulerConfig], options: Dict[str, Any]) -> Tuple[SchedulerConfig, Optional[int]]:
    """The store's scheduler settings (``merge`` off) over ``defaults()``, and the grain it asks
    for: ``grain_bytes``, else a partition size given, else None (rank 0 chooses it)."""
    if options.get("merge") is not None and parse_bool(options["merge"], "merge"):
        raise ValueError("merge=True does not apply to ScheduledKVStore: MXNet sends every server key "
                         "as a request of its own, so the parameter-server backend never fuses pieces "
                         "into one transfer; leave merge unset")
    # A config passed in is the user's choice as a whole, its partition included.
    partition_given = config is not None
    config = SchedulerConfig.build(config, defaults=defaults(), **options).with_options(merge=False)
    partition_given = partition_given or config.given("partition_bytes")
    grain = parse_size(grain_bytes, "grain_bytes") if grain_bytes is not None else \
        config.partition_bytes if partition_given else None
    if grain is not None and grain > config.partition_bytes:
        raise ValueError(f"grain_bytes={grain} is larger than partition_bytes={config.partition_bytes}; "
                         "a piece holds whole grains, so the grain must not exceed the partition size")
    return config, grain


class ScheduledKVStore(mx.kvstore.KVStoreBase):
    """Wraps an MXNet KVStore (or creates one from a type string); see the module docstring.

    ``ScheduledKVStore(store, ...)`` returns a :class:`DistKVStore` when ``store`` is a
    ``dist_*`` store and a :class:`PassThroughKVStore` otherwise; this class holds what the two
    share: the inner store, its identity, the partition check, ``overlap`` and the context
    manager.

    Args:
        store: an ``mx.kv.KVStore`` or a store type string such as ``"dist_sync"``.
        grain_bytes: size of the sub-keys large keys are split into on the servers, and the
            smallest partition size allowed during the run. Default: ``partition_bytes`` when
            one is given (as an option, in the environment, a plan or ``config``); with none,
            rank 0 chooses it at the first ``init`` from a probe of the link to the servers
            (:mod:`bytescheduler.mxnet.grain`: 4 MiB sub-keys on 1-2 servers on a slow link,
            64 MiB, MXNet's own keys in practice, on a fast one). Every worker uses rank 0's.
        config, **options: the scheduler's options (``partition_bytes=``, ``credit_bytes=``,
            ``timeout=``, ``auto_tune=``, ``timeline=``, ...; see
            :class:`~bytescheduler.core.config.SchedulerConfig`); rank 0's count. Unset ones come
            from the environment or :func:`store_defaults` (a 64 MiB credit; a partition that
            follows the number of servers, ``DMLC_NUM_SERVER``: 4 MiB on 1-2 servers, halved
            each time they double, 256 KiB at least, see
            :func:`~bytescheduler.core.grain.server_grain_bytes`; ``adaptive``: rank 0
            times steps of MXNet's own calls against scheduled ones and runs the faster, see
            :mod:`bytescheduler.mxnet.plain`). ``merge`` is off
            and ``merge=True`` is refused. With ``auto_tune``, rank 0 tunes partition (not below
            the grain) and credit online (see :class:`~bytescheduler.core.tuning.AutoTuner`); a
            step begins at the push of a key already pushed in the current step (gluon pushes
            every key once per step; :class:`~bytescheduler.mxnet.plain.StepClock`).
    """

    _forward: ForwardOverlap  # set by each kind: the forward pre-hooks of :meth:`overlap`

    def __new__(cls, store: Any = "dist_sync", *, grain_bytes: Optional[Size] = None,
                config: Optional[SchedulerConfig] = None, **options: Any) -> ScheduledKVStore:
        if cls is ScheduledKVStore:
            cls = DistKVStore if _names_dist(store) else PassThroughKVStore
        return super().__new__(cls)

    def __init__(self, inner: Any) -> None:
        """The part both kinds share; each kind's constructor checks its options first."""
        self._inner = inner
        self._type = inner.type
        self._rank = inner.rank
        self._num_workers = inner.num_workers
        self._closed = False

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
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def scheduler(self) -> Optional[Scheduler]:
        """The core scheduler; None on a pass-through store."""
        raise NotImplementedError

    @property
    def driver(self) -> Optional[ModeDriver]:
        """The mode switch (None: every step scheduled, or nothing scheduled); see
        :mod:`bytescheduler.mxnet.plain`."""
        raise NotImplementedError

    @property
    def partition_bytes(self) -> int:
        """The current size of the scheduled pieces (see :meth:`set_partition_bytes`)."""
        raise NotImplementedError

    @property
    def grain_bytes(self) -> Optional[int]:
        """The size of the sub-keys on the servers, fixed for the run at the first ``init`` of a
        dist store (rank 0's, see :mod:`bytescheduler.mxnet.grain`); before it, the grain this
        worker asks for, None when rank 0 is to choose it from a probe of the link."""
        raise NotImplementedError

    @property
    def link_rate(self) -> Optional[float]:
        """The push+pull rate (bytes per second) rank 0's probe measured at the first ``init``
        on this worker, None when the grain was given (no probe) or the store is not dist."""
        raise NotImplementedError

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
        self._repartition(size)
        return size

    def _repartition(self, size: int) -> None:
        """Cut the pieces at ``size`` from now on (checked with :meth:`_check_partition`)."""
        raise NotImplementedError

    def _check_partition(self, size: int) -> None:
        """Refuse a partition below the grain, or on a closed store."""
        if size < self.grain_bytes:
            raise ValueError(
                f"partition_bytes={size} is below the server grain of {self.grain_bytes} bytes fixed "
                "when the store was created (smaller pieces would need new server keys, losing their "
                "optimizer state); create the ScheduledKVStore with a smaller grain_bytes")
        self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise ByteSchedulerError("the ScheduledKVStore was closed")

    def overlap(self, net) -> List[Any]:
        """Let the next forward start while the last pulls are still being queued.

        Registers a forward pre-hook on ``net`` and every child block that waits until the
        pulls of the block's own parameters have been queued; ``pushpull`` into these
        parameters then returns at once (hybridized blocks: see :mod:`bytescheduler.mxnet.overlap`).
        Returns the hook handles (``handle.detach()`` removes one).
        """
        return self._forward.register(net)

    def synchronize(self) -> None:
        """Wait until every scheduled operation completed (e.g. before reading the weights)."""
        raise NotImplementedError

    def close(self, wait: bool = True) -> None:
        """Finish (``wait=True``) or abandon scheduled work and join the threads; idempotent."""
        raise NotImplementedError

    def __enter__(self) -> "ScheduledKVStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)


class DistKVStore(ScheduledKVStore):
    """A ``dist_*`` store's ScheduledKVStore: every call goes through the core scheduler (or, with
    ``adaptive``, MXNet's own calls on the steps rank 0 runs plain); made by
    ``ScheduledKVStore(store, ...)``, whose arguments it takes.

    Threads run from construction to :meth:`close` (at interpreter exit at the latest). The grain
    is decided at the first ``init`` (:meth:`_start`), when the workers connect to rank 0.
    """

    def __init__(self, store: Any = "dist_sync", *, grain_bytes: Optional[Size] = None,
                 config: Optional[SchedulerConfig] = None, **options: Any) -> None:
        _check_kind(self, store)
        config, grain = _settings(lambda: store_defaults(num_servers()), grain_bytes, config, options)
        super().__init__(_inner_store(store))
        # The grain is rank 0's, decided at the first init (_start; grain.py): its own choice,
        # or, with none (None), from a probe of the link.
        self._grain_choice = grain
        self._link_rate: Optional[float] = None
        self._layout = KeyLayout(None)
        self._close_lock = threading.Lock()
        self._optimizer = None
        self._optimizer_sent = False
        hint = engine_hint(dict(os.environ))
        if hint is not None:
            log.warning(f"rank {self._rank}: {hint}")
        self._backend = KVBackend(self._inner, self._rank, self._num_workers, config.timeout)
        self._channel = TcpOrderChannel(self._rank, config.timeout) if self._num_workers > 1 else None
        # A piece holds whole sub-keys: the tuner's search stays at or above the grain.
        self._scheduler = Scheduler(self._backend, channel=self._channel, rank=self._rank, config=config,
                                    tuning={"min_partition_bytes": grain or config.partition_bytes})
        self._jobs = JobQueue(self._scheduler, self._rank, config.timeout)
        self._forward = ForwardOverlap(self._jobs.wait_queued)
        self._modes = StoreModes(self._inner, self._rank, self._num_workers, self._layout, self._scheduler,
                                 self.synchronize, self._jobs.wait_done)
        self._plain_calls = self._modes.calls
        self._config = config  # rank 0's shared settings once the first init connected the workers
        self._modes.configure(config)
        # Threads left running at exit would crash MXNet's shutdown: close at exit what is open.
        atexit.register(self.close)

    # ------------------------------------------------------------------ properties

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @property
    def driver(self) -> Optional[ModeDriver]:
        return self._modes.driver

    @property
    def partition_bytes(self) -> int:
        return self._scheduler.config.partition_bytes

    @property
    def grain_bytes(self) -> Optional[int]:
        if self._layout.grain_bytes is None:
            return self._grain_choice
        return self._layout.grain_bytes

    @property
    def link_rate(self) -> Optional[float]:
        return self._link_rate

    def _repartition(self, size: int) -> None:
        if self._layout.grain_bytes is None and self._grain_choice is None:
            self._grain_choice = size  # before the first init: a partition chosen is the grain
        self._check_partition(size)
        self._scheduler.reconfigure(partition_bytes=size)

    # ------------------------------------------------------------------ helpers

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        self._check_open()
        return self._backend.call(fn, what)

    def _check_usable(self) -> None:
        self._check_open()
        self._scheduler.check()

    def _create_keys(self, pairs: List[Any], what: str) -> List[KeyInfo]:
        """Register the keys (the first time: connect the workers and fix the grain) and create
        their sub-keys (collective)."""
        if self._layout.grain_bytes is None:  # the first init: its keys checked before any collective
            kind, _ = self._layout.check_new(pairs)
            self._start(kind)
        infos = self._layout.register(pairs, self._optimizer if self._optimizer_sent else None)
        values = [value for _, value in pairs]
        self._call(lambda: self._inner.init(*self._layout.init_args(infos, values)), what)
        if self._optimizer_sent and any(i.partitioned for i in self._layout.infos()):
            log.warning("a partitioned key was initialised after the optimizer was sent; sending it "
                        "again (the servers' optimizer states are reset)")
            self._optimizer_sent = False
            self._send_optimizer()
        return infos

    def _start(self, kind: Optional[type]) -> None:
        """The first init's start-up (collective): every worker connects to rank 0's ordering
        channel and runs with rank 0's settings and grain; with no grain chosen on rank 0,
        every worker takes part in the link probe and rank 0 picks the grain (grain.py)."""
        grain = self._grain_choice
        if self._channel is not None:
            leader, leaders_grain = self._backend.connect_channel(
                self._channel, KeyLayout.reserved_key("order", kind), self._config, grain)
            self._adopt(leader)
            if grain is not None and leaders_grain != grain:
                theirs = f"{leaders_grain}" if leaders_grain is not None else "chosen from a probe of the link"
                log.warning(f"rank {self._rank}: the server grain is {grain} here but {theirs} on rank 0; "
                            "using rank 0's")
            grain = leaders_grain
        servers = num_servers()
        if grain is None and servers > COARSE_SERVERS:  # the same on every worker: nothing to probe
            grain = choose_grain(0.0, servers, self._config.credit_bytes)
        if grain is None:
            rate = self._call(lambda: probe_rate(self._inner, KeyLayout.reserved_key("probe", kind)),
                              "probing the link to the servers")
            grain = choose_grain(rate, servers, self._config.credit_bytes)
            if self._num_workers > 1:
                chosen = grain
                grain = int(self._call(lambda: rank0_json(self._inner, KeyLayout.reserved_key("grain", kind),
                                                          chosen, 32), "sharing rank 0's grain"))
            self._link_rate = rate
            log.info(f"rank {self._rank}: push+pull to the servers at {rate / 1e6:.0f} MB/s; "
                     f"server grain {grain} bytes (rank 0's choice)")
        self._layout.decide(grain)
        if self._scheduler.config.partition_bytes < grain:  # a piece holds whole sub-keys
            self._scheduler.reconfigure(partition_bytes=grain)

    def _adopt(self, leader: SchedulerConfig) -> None:
        """Run with rank 0's shared settings (core/agreement.py), learned at the first init."""
        agreed, notes = from_rank_0(self._config, leader, self._rank)
        for note in notes:
            log.warning(note)
        self._config = agreed
        if agreed.timeout != self._backend.timeout:
            self._backend.timeout = self._jobs.timeout = agreed.timeout
            self._scheduler.set_timeout(agreed.timeout)
        if self._rank != 0:  # only rank 0 decides pieces; its sizes are the ones that count
            self._scheduler.reconfigure(agreed.partition_bytes, agreed.credit_bytes)
        self._modes.configure(agreed)

    def _run_jobs(self, jobs: List[Job], wait: Callable[[Job], bool] = lambda job: True) -> None:
        self._forward.record(jobs)
        self._jobs.run(jobs, wait)

    # ------------------------------------------------------------------ init / broadcast

    def init(self, key, value) -> None:
        self._check_open()
        self._create_keys([(k, as_list(v)[0]) for k, v in key_pairs(key, value)], f"init({key!r})")

    def broadcast(self, key, value, out, priority=0) -> None:
        self._check_open()
        pairs = [(k, as_list(v)[0]) for k, v in key_pairs(key, value)]
        outs = [as_list(o) for _, o in key_pairs(key, out)]
        for (k, v), o in zip(pairs, outs):
            check_arrays(k, o, v.shape, v.dtype, "out")
        infos = self._create_keys(pairs, f"broadcast({key!r})")
        # The pull is an operation of the key: the key's first push waits until it completed.
        self._run_jobs([Job("pull", info, [], o, priority) for info, o in zip(infos, outs)])

    # ------------------------------------------------------------------ push / pull / pushpull

    def push(self, key, value, priority=0) -> None:
        self._check_usable()
        infos, values = [], []
        for k, v in key_pairs(key, value):
            info = self._layout.info(k)
            arrays = as_list(v)
            info.check(arrays, "value")
            infos.append(info)
            values.append(arrays)
        self._send_optimizer()
        if self._modes.begin_step(infos):
            self._plain_calls.push(infos, values, priority)
            return
        self._run_jobs([Job("push", info, arrays, [], priority) for info, arrays in zip(infos, values)])

    def pull(self, key, out=None, priority=0, ignore_sparse=True) -> None:
        if out is None:
            raise ValueError("pull needs out=")
        self._check_usable()
        infos, outs = [], []
        for k, o in key_pairs(key, out):
            info = self._layout.info(k)
            arrays = as_list(o)
            info.check(arrays, "out")
            infos.append(info)
            outs.append(arrays)
        if self._modes.plain:
            self._plain_calls.pull(infos, outs, priority, ignore_sparse)
            return
        self._run_jobs([Job("pull", info, [], arrays, priority, ignore_sparse) for info, arrays in zip(infos, outs)])

    def pushpull(self, key, value, out=None, priority=0) -> None:
        self._check_usable()
        pairs = key_pairs(key, value)
        given = [o for _, o in key_pairs(key, out)] if out is not None else [None] * len(pairs)
        infos, values, outs = [], [], []
        for (k, v), o in zip(pairs, given):
            info = self._layout.info(k)
            arrays = as_list(v)
            out_list = arrays if o is None else as_list(o)
            info.check(arrays, "value")
            info.check(out_list, "out")
            infos.append(info)
            values.append(arrays)
            outs.append(out_list)
        self._send_optimizer()
        if self._modes.begin_step(infos):
            self._plain_calls.pushpull(infos, values, outs, priority)
            return
        jobs = [Job("pushpull", *args, priority) for args in zip(infos, values, outs)]
        self._run_jobs(jobs, lambda job: not self._forward.covered(job.outs, job.values))

    # ------------------------------------------------------------------ optimizer

    def set_optimizer(self, optimizer) -> None:
        self._check_open()
        check_optimizer(optimizer, self._layout.infos())
        # Sent at the first push/pushpull, when the sub-keys of every key are known.
        self._optimizer = optimizer
        self._optimizer_sent = False
        if self._layout.infos():
            self._send_optimizer()

    def _send_optimizer(self) -> None:
        if self._optimizer is None or self._optimizer_sent:
            return
        check_optimizer(self._optimizer, self._layout.infos())
        server = self._layout.server_optimizer(self._optimizer)
        self._call(lambda: self._inner.set_optimizer(server), "set_optimizer")
        self._optimizer_sent = True

    def set_gradient_compression(self, compression_params) -> None:
        self._call(lambda: self._inner.set_gradient_compression(compression_params), "set_gradient_compression")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        self.synchronize()
        return self._call(lambda: self._inner.save_optimizer_states(fname, dump_optimizer), "save_optimizer_states")

    def load_optimizer_states(self, fname):
        self.synchronize()
        return self._call(lambda: self._inner.load_optimizer_states(fname), "load_optimizer_states")

    def _barrier(self) -> None:
        self.synchronize()
        self._call(self._inner._barrier, "_barrier")

    # ------------------------------------------------------------------ end

    def synchronize(self) -> None:
        self._plain_calls.drain()
        for info in self._layout.infos():
            self._jobs.wait_key(info)
        self._scheduler.flush()

    def close(self, wait: bool = True) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        latch = ErrorLatch()
        try:
            if wait:
                try:
                    self._plain_calls.drain()
                    for info in self._layout.infos():
                        self._jobs.wait_key(info)
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
            timeout = 1.0 if latch else 5.0
            stopped = self._jobs.close(timeout)
            if not self._backend.close(timeout) or not stopped:
                log.warning("ScheduledKVStore threads did not stop (a peer may have died)")
        latch.raise_if_set()


def _passed_through(method: Callable) -> Callable:
    """A method with ``method``'s signature that calls the inner store's method of its name."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: "PassThroughKVStore", *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)
    call.__qualname__ = f"PassThroughKVStore.{name}"
    return call


class PassThroughKVStore(ScheduledKVStore):
    """The ScheduledKVStore of a store that is not ``dist_*`` (``local``, ``device``, ...): every
    call goes straight to the inner store with its arguments; nothing is scheduled and no thread
    runs. Made by ``ScheduledKVStore(store, ...)``, whose arguments it takes and checks.

    ``partition_bytes`` and ``grain_bytes`` are kept and checked as on a dist store (the grain is
    fixed at construction: ``grain_bytes``, else the partition size), so code that sets them
    runs unchanged on one process. ``overlap`` registers hooks that find nothing to wait for.
    """

    scheduler = None
    driver = None
    link_rate = None

    def __init__(self, store: Any, *, grain_bytes: Optional[Size] = None,
                 config: Optional[SchedulerConfig] = None, **options: Any) -> None:
        _check_kind(self, store)
        config, grain = _settings(lambda: KVSTORE_DEFAULTS, grain_bytes, config, options)
        super().__init__(_inner_store(store))
        self._grain = grain or config.partition_bytes
        self._partition_bytes = config.partition_bytes
        self._forward = ForwardOverlap(lambda job: None)  # no job is ever recorded here

    @property
    def partition_bytes(self) -> int:
        return self._partition_bytes

    def _repartition(self, size: int) -> None:
        self._check_partition(size)
        self._partition_bytes = size

    @property
    def grain_bytes(self) -> int:
        return self._grain

    init = _passed_through(DistKVStore.init)
    broadcast = _passed_through(DistKVStore.broadcast)
    push = _passed_through(DistKVStore.push)
    pull = _passed_through(DistKVStore.pull)
    pushpull = _passed_through(DistKVStore.pushpull)
    set_optimizer = _passed_through(DistKVStore.set_optimizer)
    set_gradient_compression = _passed_through(DistKVStore.set_gradient_compression)
    save_optimizer_states = _passed_through(DistKVStore.save_optimizer_states)
    load_optimizer_states = _passed_through(DistKVStore.load_optimizer_states)
    _barrier = _passed_through(DistKVStore._barrier)

    def synchronize(self) -> None:
        """Nothing to wait for: every call went to the inner store."""

    def close(self, wait: bool = True) -> None:
        """Mark the store closed (:meth:`set_partition_bytes` refuses then); idempotent."""
        self._closed = True
