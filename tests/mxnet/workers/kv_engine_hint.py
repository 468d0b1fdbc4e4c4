"""dist_sync worker: which engine setting the launcher gave it, and the store's hint without it.

    kv_engine_hint.py [--drop]

Prints ``BULK rank=R value=V`` (MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD as launched, or
``unset``). With ``--drop`` the variable is removed before the store is created, as for a
worker started by another launcher, and the store's warning (its logger's records) is
printed as ``HINT rank=R ...``. Then one pushpull, checked, and ``HINT DONE rank=R``.
"""

import logging
import os
import sys

import mxnet as mx

from bytescheduler.launcher import run_worker

VARIABLE = "MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD"


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    value = os.environ.get(VARIABLE, "unset")
    if "--drop" in sys.argv:
        os.environ.pop(VARIABLE, None)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("bytescheduler.mxnet").addHandler(handler)
    kv = ScheduledKVStore("dist_sync", timeout=30)
    print(f"BULK rank={kv.rank} value={value}")
    for message in warnings:
        print(f"HINT rank={kv.rank} {message}")
    kv.init(0, mx.nd.zeros((16,)))
    grad = mx.nd.ones((16,)) * (kv.rank + 1)
    kv.pushpull(0, grad)
    assert (grad.asnumpy() == 3).all(), grad
    kv.close()
    print(f"HINT DONE rank={kv.rank}")


if __name__ == "__main__":
    run_worker(main)
