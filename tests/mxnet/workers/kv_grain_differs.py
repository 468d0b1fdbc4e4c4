"""dist_sync worker: grains that differ between workers; every worker uses rank 0's.

Usage: ``kv_grain_differs.py RANK0 OTHERS``, each a grain in bytes or ``auto`` (no grain nor
partition given: rank 0 chooses it from a probe of the link). Before the first init each
worker reports its own; after it every worker holds rank 0's (a worker whose own differed
logs a warning), probes the link only when rank 0 has no grain, and a key of 3,000 float32
split at that grain sums as MXNet does (no hang: different grains would make the workers'
server keys differ). Prints ``DIFFERS rank=R grain=G probed=0|1``.
"""

import sys

import mxnet as mx
import numpy as np

from bytescheduler.launcher import run_worker

ELEMENTS = 3_000


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    inner = mx.kv.create("dist_sync")  # wrapped below, once its rank is known
    mine = sys.argv[1] if inner.rank == 0 else sys.argv[2]
    leaders = sys.argv[1]
    options = {} if mine == "auto" else {"grain_bytes": int(mine), "partition_bytes": 4 * int(mine)}
    kv = ScheduledKVStore(inner, timeout=60.0, **options)
    assert kv.grain_bytes == (None if mine == "auto" else int(mine)), kv.grain_bytes
    kv.init(0, mx.nd.zeros((ELEMENTS,)))
    if leaders != "auto":
        assert kv.grain_bytes == int(leaders) and kv.link_rate is None, (kv.grain_bytes, kv.link_rate)
    else:
        assert kv.link_rate > 0, kv.link_rate
    out = mx.nd.zeros((ELEMENTS,))
    kv.pushpull(0, mx.nd.ones((ELEMENTS,)) * (kv.rank + 1), out=out)
    kv.synchronize()
    assert (out.asnumpy() == 3).all(), out.asnumpy()[:5]
    print(f"DIFFERS rank={kv.rank} grain={kv.grain_bytes} probed={int(kv.link_rate is not None)}")
    kv.close()


if __name__ == "__main__":
    run_worker(main)
