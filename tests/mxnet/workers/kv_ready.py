"""dist_sync worker: a push enters the scheduler once its array is computed, not when it is called.

    kv_ready.py TRACE_DIR SLOW_KEY

Key SLOW_KEY (0 or 1) pushes an array MXNet's engine is still computing (a chain of matrix
products queued just before the call); the other key pushes an array that is ready. (Its push
then waits in MXNet's engine behind the products, which run on the same engine thread.) Both go
in one ``pushpull`` call, key 0 first, with the same priority. Prints
``READY rank=R computed=T0 called=T1 done=T2`` (wall-clock seconds: when the slow array was
computed, when the call was made, when the call returned); the scheduler's timeline
(``TRACE_DIR/ready.rankR.json``) holds when each key's task entered the scheduler and finished.
"""

import os
import sys
import threading
import time

import mxnet as mx
import numpy as np

from bytescheduler.launcher import run_worker

SIDE = 400
# The slow array must take well over the test's 0.1 s to compute on any machine: the chain's
# length is set from timed samples of products (a fixed count took only 95 ms on one CI machine).
SLOW_SECONDS = 0.4


def products_for(seconds: float, factor) -> int:
    sample = 5
    mx.nd.dot(factor, factor).wait_to_read()  # warm up
    # The fastest of a few samples, as in kv_early.py: one sample taken while the other rank's
    # processes hold the core reads the products as slow and makes the chain too short.
    took = []
    for _ in range(3):
        began = time.perf_counter()
        product = factor
        for _ in range(sample):
            product = mx.nd.dot(product, factor)
        product.wait_to_read()
        took.append(time.perf_counter() - began)
    each = min(took) / sample
    return max(sample, int(seconds / each) + 1)


def main(trace_dir: str, slow_key: int) -> None:
    os.environ["BYTESCHEDULER_TIMELINE"] = os.path.join(trace_dir, "ready.json")
    from bytescheduler.mxnet.kvstore import ScheduledKVStore

    kv = ScheduledKVStore("dist_sync", timeout=60)
    fast_key = 1 - slow_key
    kv.init(slow_key, mx.nd.zeros((SIDE, SIDE)))
    kv.init(fast_key, mx.nd.zeros((100,)))
    factor = mx.nd.ones((SIDE, SIDE)) / SIDE
    fast = mx.nd.ones((100,)) * (kv.rank + 1)
    mx.nd.waitall()
    products = products_for(SLOW_SECONDS, factor)
    slow = factor
    for _ in range(products):  # queued on the engine; computed over the next fraction of a second
        slow = mx.nd.dot(slow, factor)
    called = time.time()
    computed = []
    watcher = threading.Thread(target=lambda: (slow.wait_to_read(), computed.append(time.time())))
    watcher.start()
    kv.pushpull([0, 1], [slow, fast] if slow_key == 0 else [fast, slow])
    returned = time.time()
    watcher.join()
    assert (fast.asnumpy() == 3).all(), fast  # the two workers' (rank + 1) summed
    assert np.allclose(slow.asnumpy(), 2.0 / SIDE), slow.asnumpy()[0, :3]
    kv.close()
    print(f"READY rank={kv.rank} computed={computed[0]:.6f} called={called:.6f} done={returned:.6f}")


if __name__ == "__main__":
    run_worker(main, sys.argv[1], int(sys.argv[2]))
