"""dist_sync worker: rank 1 stops communicating; rank 0 must raise within the timeout.

Rank 0 prints ``RAISED <type>: ...`` and fails (exit 7) through run_worker; rank 1 sleeps until
the launcher stops it.
"""

import sys
import time

import mxnet as mx

from bytescheduler.launcher import run_worker

TIMEOUT = 5.0


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    kv = ScheduledKVStore("dist_sync", partition_bytes=64, timeout=TIMEOUT)
    kv.init(0, mx.nd.zeros((100,)))
    grad, weight = mx.nd.ones((100,)), mx.nd.zeros((100,))
    kv.pushpull(0, grad, out=weight)
    weight.wait_to_read()
    print(f"STEP0 OK rank={kv.rank}")
    if kv.rank == 1:
        print("STALLING")
        time.sleep(1000)
    start = time.monotonic()
    try:
        for _ in range(3):
            kv.pushpull(0, grad, out=weight)
        kv.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"RAISED {type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}")
        sys.exit(7)
    raise AssertionError("no error although rank 1 stopped")


if __name__ == "__main__":
    run_worker(main)
