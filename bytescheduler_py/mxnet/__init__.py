"""MXNet support.

* :mod:`bytescheduler.mxnet.launch` starts a parameter-server job on one machine (imports no MXNet).
* :class:`bytescheduler.mxnet.kvstore.ScheduledKVStore` schedules and partitions a ``dist_*``
  KVStore's communication (imports MXNet; loaded only when used).
"""


def __getattr__(name):
    if name == "ScheduledKVStore":
        from .kvstore import ScheduledKVStore

        return ScheduledKVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
