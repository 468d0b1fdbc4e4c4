"""dist_sync worker: an operation that finishes early is reported done early, not after older ones.

    kv_early.py TRACE_DIR

Key 0's pull cannot finish for most of a second: the array it is pulled into is still being
read by a long matrix product queued just before (MXNet's engine makes the pull's write wait for
it). Key 1, issued right after key 0, finishes at once. MXNet's engine runs with two CPU worker
threads (``MXNET_CPU_WORKER_NTHREADS=2``), so the product does not hold up key 1's calls.
Prints ``EARLY rank=R computed=T`` (wall-clock seconds: when the product finished); the
scheduler's timeline (``TRACE_DIR/early.rankR.json``) holds when each key's task finished. After
``close`` no thread of the store's is left running (the waiter threads included).
"""

import os
import sys
import threading
import time

import mxnet as mx

from bytescheduler.launcher import run_worker

SIDE = 200
# The product must take well over the test's margin on any machine: its width is set from a
# timed sample.
SLOW_SECONDS = 0.8


def width_for(seconds: float, left) -> int:
    sample = 2000
    right = mx.nd.ones((SIDE, sample))
    mx.nd.dot(left, right).wait_to_read()  # warm up
    # The fastest of a few samples: one taken while the other rank's processes hold the core
    # made the product 0.3 s instead of 0.8 s, and the margin of the test went with it.
    took = []
    for _ in range(3):
        began = time.perf_counter()
        mx.nd.dot(left, right).wait_to_read()
        took.append(time.perf_counter() - began)
    return max(sample, int(sample * seconds / min(took)))


def main(trace_dir: str) -> None:
    os.environ["BYTESCHEDULER_TIMELINE"] = os.path.join(trace_dir, "early.json")
    from bytescheduler.mxnet.kvstore import ScheduledKVStore

    kv = ScheduledKVStore("dist_sync", timeout=60)
    kv.init(0, mx.nd.zeros((SIDE, SIDE)))
    kv.init(1, mx.nd.zeros((100,)))
    early_in = mx.nd.ones((SIDE, SIDE)) * (kv.rank + 1)
    late_in = mx.nd.ones((100,)) * (kv.rank + 1)
    slow_out, fast_out = mx.nd.zeros((SIDE, SIDE)), mx.nd.zeros((100,))
    right = mx.nd.ones((SIDE, width_for(SLOW_SECONDS, slow_out)))
    mx.nd.waitall()
    product = mx.nd.dot(slow_out, right)  # reads slow_out: key 0's pull into it waits for the product
    computed = []
    watcher = threading.Thread(target=lambda: (product.wait_to_read(), computed.append(time.time())))
    watcher.start()
    kv.pushpull(0, early_in, out=slow_out, priority=0)
    kv.pushpull(1, late_in, out=fast_out, priority=-1)
    kv.synchronize()
    watcher.join()
    assert (fast_out.asnumpy() == 3).all(), fast_out
    assert (slow_out.asnumpy() == 3).all(), slow_out
    assert (product.asnumpy() == 0).all()  # the product read slow_out before the pull wrote it
    kv.close()
    left = [thread.name for thread in threading.enumerate() if thread.name.startswith("bytescheduler")]
    assert not left, f"threads left running after close: {left}"
    print(f"EARLY rank={kv.rank} computed={computed[0]:.6f}")


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
