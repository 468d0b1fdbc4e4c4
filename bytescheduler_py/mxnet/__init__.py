"""MXNet support: :class:`bytescheduler.mxnet.kvstore.ScheduledKVStore` schedules and partitions a
``dist_*`` KVStore's communication (imports MXNet; loaded only when used).

* :mod:`~bytescheduler.mxnet.kvstore`: the facade, MXNet's KVStore API (a ``DistKVStore`` over a
  ``dist_*`` store, a ``PassThroughKVStore`` over any other).
* :mod:`~bytescheduler.mxnet.keys`: user keys as sub-keys of one grain on the servers.
* :mod:`~bytescheduler.mxnet.grain`: the grain, chosen at the first ``init`` from a probe of the link.
* :mod:`~bytescheduler.mxnet.backend`: the threads that call the inner store, in rank 0's order.
* :mod:`~bytescheduler.mxnet.overlap`: the forward pre-hooks of ``kv.overlap(net)``.

The job launcher (``bytescheduler mxnet-launch``, ``run_worker``) imports no MXNet and lives in
:mod:`bytescheduler.launcher`.
"""


def __getattr__(name):
    if name == "ScheduledKVStore":
        from .kvstore import ScheduledKVStore

        return ScheduledKVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
