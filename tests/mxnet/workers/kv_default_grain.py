"""dist_sync worker: with no partition given, rank 0 chooses the grain from a probe of the link.

Usage: ``kv_default_grain.py RANK0 OTHERS`` where each is ``slow`` or ``fast``: the link-rate
threshold (``bytescheduler.core.grain.FAST_LINK_BYTES_PER_S``) is set on each worker so that its probe reads
the link as slow (sub-keys of ``server_grain_bytes(DMLC_NUM_SERVER)``) or fast
(``COARSE_GRAIN_BYTES``). Only rank 0's reading may count: every worker must end up with
the grain rank 0's reading gives, whatever its own says.

Then a key of 1,200,000 float32 (4.8 MB, above MXNet's 1,000,000-element bound, so MXNet's own
layout spreads it over every server), split into sub-keys of that grain or kept whole, must
pushpull rank-dependent values bitwise as the unwrapped store does under a key of its own.
Also checks that the store's mode switch leaves two steps untimed after a switch. Prints
``GRAIN rank=R servers=S partition=P grain=G subkeys=N rate=MB/s``.
"""

import sys

import mxnet as mx
import numpy as np

from bytescheduler.core.grain import server_grain_bytes
from bytescheduler.launcher import run_worker

ELEMENTS = 1_200_000


def main() -> None:
    from bytescheduler.core import grain
    from bytescheduler.mxnet.kvstore import ScheduledKVStore, num_servers
    readings = {"slow": float("inf"), "fast": 0.0}
    kv = ScheduledKVStore("dist_sync", timeout=60.0)
    grain.FAST_LINK_BYTES_PER_S = readings[sys.argv[1] if kv.rank == 0 else sys.argv[2]]
    servers = num_servers()
    assert kv.grain_bytes is None and kv.link_rate is None, (kv.grain_bytes, kv.link_rate)
    # The store's mode switch leaves two steps untimed after a switch (mxnet/plain.py).
    assert kv.driver.chooser.settle == 2, kv.driver.chooser.settle
    coarse = sys.argv[1] == "fast" and servers <= 2
    expected = grain.COARSE_GRAIN_BYTES if coarse else server_grain_bytes(servers)
    values = np.random.RandomState(7 + kv.rank).uniform(-1, 1, ELEMENTS).astype(np.float32)
    kv.init(0, mx.nd.zeros((ELEMENTS,)))
    assert kv.grain_bytes == expected, (kv.rank, sys.argv, kv.grain_bytes, expected)
    assert kv.partition_bytes >= kv.grain_bytes, (kv.partition_bytes, kv.grain_bytes)
    # Probed on 1-2 servers only (grain.choose_grain): on more the grain follows their number.
    assert (kv.link_rate > 0) if servers <= 2 else (kv.link_rate is None), kv.link_rate
    kv.synchronize()  # the inner store is called from this thread only while ours is idle
    kv.inner.init(1, mx.nd.zeros((ELEMENTS,)))  # the unwrapped store's own key, MXNet's layout
    ours, theirs = mx.nd.zeros((ELEMENTS,)), mx.nd.zeros((ELEMENTS,))
    for _ in range(2):
        kv.pushpull(0, mx.nd.array(values), out=ours, priority=0)
        kv.synchronize()
        kv.inner.pushpull(1, mx.nd.array(values), out=theirs, priority=0)
        mx.nd.waitall()
    assert np.array_equal(ours.asnumpy(), theirs.asnumpy()), "the key's sums differ from MXNet's own"
    subkeys = -(-ELEMENTS * 4 // kv.grain_bytes)
    print(f"GRAIN rank={kv.rank} servers={servers} partition={kv.partition_bytes} grain={kv.grain_bytes} "
          f"subkeys={subkeys} rate={(kv.link_rate or 0) / 1e6:.0f}")
    kv.close()


if __name__ == "__main__":
    run_worker(main)
