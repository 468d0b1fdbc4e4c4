"""The server grain, chosen at the first ``init`` from a probe of the link to the servers.

The grain (the size of the sub-keys large keys become on the servers, :mod:`.keys`) is fixed
at the first ``init``: the servers keep each key's value and optimizer state. Sub-keys cost
every step a request and a server update each, CPU that the servers often take from the
workers' own cores, and they win where the link is slow: a server updates and returns the
first part of a large layer while the rest is still being pushed. Measured on 2 workers
(docs/benchmarks.md, twelfth and thirteenth rounds): 4 MiB sub-keys 0.99-1.09x of
``dist_sync`` on the VGG-like model at 1 Gbit/s, where 64 MiB (MXNet's own keys) is 0.98x;
on the CPU-bound MLP on loopback 0.92x, where 64 MiB is 0.99x. No grain wins both.

So unless the user fixes it (``grain_bytes=``, or a partition size given as an option, in the
environment, a plan or a ``config``), rank 0 decides it at the first ``init``: every worker
pushes and pulls a probe key a few times (collective, like ``init``), rank 0 times it, and
picks :data:`COARSE_GRAIN_BYTES` when the rate is at least :data:`FAST_LINK_BYTES_PER_S` on
1-2 servers, and :func:`~bytescheduler.core.config.server_grain_bytes` otherwise (on more
servers the probe is not taken: see :func:`choose_grain`); every worker uses
rank 0's grain (:meth:`ScheduledKVStore._start <bytescheduler.mxnet.kvstore.ScheduledKVStore>`).
"""

from __future__ import annotations

import time
from typing import Any

import mxnet as mx

from ..core.config import server_grain_bytes

# The probe: a float32 key of this size (above MXNet's big-array bound, so spread over every
# server as a 4 MiB sub-key is), one push+pull to warm up, then the best of PROBE_ROUNDS.
PROBE_BYTES = 8 * 1024**2
PROBE_ROUNDS = 5
# At or above this push+pull rate (bytes of the key per second) the link is fast enough that
# sub-keys cost more than they win; see the module docstring and the measurements it names.
FAST_LINK_BYTES_PER_S = 250 * 1000**2
# The grain on a fast link: every key of the bench's models whole, as MXNet keeps it; only
# with this many servers or fewer (choose_grain).
COARSE_GRAIN_BYTES = 64 * 1024**2
COARSE_SERVERS = 2


def probe_rate(inner: Any, key: Any, nbytes: int = PROBE_BYTES, rounds: int = PROBE_ROUNDS) -> float:
    """Bytes per second of a push+pull of an ``nbytes`` key through ``inner``, a dist store
    (collective: every worker calls it with the same reserved ``key``; the key stays on the
    servers, holding zeros).

    A push+pull completes once every worker's push arrived and the servers answered, so the
    rounds keep the workers in step without a barrier; the first one absorbs their skew.
    MXNet's engine is let finish first: gluon's Trainer makes its first ``init`` in its first
    ``step``, while the backward may still be computing on the cores ps-lite needs (a probe
    taken then read 61 MB/s on a link that reads 200 MB/s idle).
    """
    mx.nd.waitall()
    array = mx.nd.zeros((nbytes // 4,), dtype="float32")
    out = mx.nd.zeros_like(array)
    inner.init(key, array)

    def once() -> float:
        start = time.perf_counter()
        inner.pushpull(key, array, out=out)
        out.wait_to_read()
        return time.perf_counter() - start

    once()
    return nbytes / min(once() for _ in range(rounds))


def choose_grain(rate: float, servers: int, credit_bytes: int) -> int:
    """The grain for a link probed at ``rate`` bytes per second with ``servers`` servers.

    Coarse only on 1-2 servers, where it was measured: from 4 servers on, the simulator
    predicts finer grains than 4 MiB winning even at 12.6 Gbit/s (docs/simulator.md, "The
    grain and the number of servers"), and a coarse key would keep every server busy with
    one large request per layer.

    >>> [choose_grain(rate, servers, 64 * 1024**2) // 1024 for rate, servers in ((100e6, 2), (400e6, 2), (400e6, 8))]
    [4096, 65536, 1024]
    """
    if rate >= FAST_LINK_BYTES_PER_S and servers <= COARSE_SERVERS:
        return COARSE_GRAIN_BYTES
    return server_grain_bytes(servers, credit_bytes)
