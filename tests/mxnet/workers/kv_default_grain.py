"""dist_sync worker: with no partition given, the store's partition and grain follow the servers.

The store takes its partition (and grain) from ``server_grain_bytes(DMLC_NUM_SERVER)``. A key
of 1,200,000 float32 (4.8 MB, above MXNet's 1,000,000-element bound, so MXNet's own layout
spreads it over every server) is split into sub-keys of that grain; its pushpull of
rank-dependent values must give bitwise what the unwrapped store gives for the same values
under a key of its own. Prints ``GRAIN rank=R servers=S partition=P grain=G subkeys=N``.
"""

import mxnet as mx
import numpy as np

from bytescheduler.core.config import server_grain_bytes
from bytescheduler.launcher import run_worker

ELEMENTS = 1_200_000


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore, num_servers
    kv = ScheduledKVStore("dist_sync", timeout=60.0)
    servers = num_servers()
    expected = server_grain_bytes(servers)
    assert kv.partition_bytes == kv.grain_bytes == expected, (servers, kv.partition_bytes, kv.grain_bytes)
    values = np.random.RandomState(7 + kv.rank).uniform(-1, 1, ELEMENTS).astype(np.float32)
    kv.init(0, mx.nd.zeros((ELEMENTS,)))
    kv.synchronize()  # the inner store is called from this thread only while ours is idle
    kv.inner.init(1, mx.nd.zeros((ELEMENTS,)))  # the unwrapped store's own key, MXNet's layout
    ours, theirs = mx.nd.zeros((ELEMENTS,)), mx.nd.zeros((ELEMENTS,))
    for _ in range(2):
        kv.pushpull(0, mx.nd.array(values), out=ours, priority=0)
        kv.synchronize()
        kv.inner.pushpull(1, mx.nd.array(values), out=theirs, priority=0)
        mx.nd.waitall()
    assert np.array_equal(ours.asnumpy(), theirs.asnumpy()), "the split key's sums differ from MXNet's own"
    subkeys = -(-ELEMENTS * 4 // expected)
    print(f"GRAIN rank={kv.rank} servers={servers} partition={kv.partition_bytes} grain={kv.grain_bytes} "
          f"subkeys={subkeys}")
    kv.close()


if __name__ == "__main__":
    run_worker(main)
