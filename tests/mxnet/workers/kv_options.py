"""dist_sync worker: the store's options are the scheduler's, given as keywords or ``config=``.

Refused before any store is created: ``merge=True``, an unknown option, options given by
position. Then one store from a ``config`` with keywords on top; its scheduler runs with them,
merge off. Prints ``OPTIONS OK rank=R``.
"""

import mxnet as mx

from bytescheduler.core import SchedulerConfig
from bytescheduler.launcher import run_worker


def refused(exc_type, words, *args, **kwargs):
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    try:
        ScheduledKVStore(*args, **kwargs)
    except exc_type as exc:
        assert words in str(exc), (words, str(exc))
        return
    raise AssertionError(f"ScheduledKVStore{args} {kwargs} was not refused")


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    refused(ValueError, "merge=True does not apply to ScheduledKVStore", "dist_sync", merge=True)
    refused(ValueError, "merge=True does not apply", "dist_sync", config=SchedulerConfig(), merge="on")
    refused(TypeError, "unknown scheduler option(s) ['partition']", "dist_sync", partition="1MB")
    refused(TypeError, "positional argument", "dist_sync", "1MB")
    config = SchedulerConfig(partition_bytes=4096, credit_bytes=8192, timeout=20.0)  # merge=True in it
    kv = ScheduledKVStore("dist_sync", grain_bytes=1024, config=config, partition_bytes="2KiB", merge=False)
    got = kv.scheduler.config
    assert (got.partition_bytes, got.credit_bytes, got.timeout, got.merge) == (2048, 8192, 20.0, False), got
    assert kv.partition_bytes == 2048 and kv.grain_bytes == 1024
    kv.init(0, mx.nd.zeros((1024,)))
    value = mx.nd.ones((1024,)) * (kv.rank + 1)
    kv.pushpull(0, value)
    assert (value.asnumpy() == 3).all(), value
    kv.close()
    print(f"OPTIONS OK rank={kv.rank}")


if __name__ == "__main__":
    run_worker(main)
