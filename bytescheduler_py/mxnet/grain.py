"""The server grain, chosen at the first ``init`` from a probe of the link to the servers.

The grain (the size of the sub-keys large keys become on the servers, :mod:`.keys`) is fixed
at the first ``init``: the servers keep each key's value and optimizer state. Sub-keys cost
every step a request and a server update each, CPU that the servers often take from the
workers' own cores, and they win where the link is slow: a server updates and returns the
first part of a large layer while the rest is still being pushed. On a fast link whole keys
(MXNet's own) win, on a slow one 4 MiB sub-keys: no grain wins both (docs/mxnet.md has the
measurements).

So unless the user fixes it (``grain_bytes=``, or a partition size given as an option, in the
environment, a plan or a ``config``), rank 0 decides it at the first ``init``: every worker
pushes and pulls a probe key a few times (collective, like ``init``), rank 0 times it, and
picks the grain with :func:`~bytescheduler.core.grain.choose_grain` (whole keys,
``COARSE_GRAIN_BYTES``, at ``FAST_LINK_BYTES_PER_S`` or more on 1-2 servers, else
``server_grain_bytes``; on more servers the probe is not taken); every worker uses
rank 0's grain (:meth:`DistKVStore._start <bytescheduler.mxnet.kvstore.DistKVStore._start>`).
"""

from __future__ import annotations

import time
from typing import Any

import mxnet as mx

from ..core.grain import COARSE_GRAIN_BYTES, COARSE_SERVERS, FAST_LINK_BYTES_PER_S, choose_grain

__all__ = ["COARSE_GRAIN_BYTES", "COARSE_SERVERS", "FAST_LINK_BYTES_PER_S", "PROBE_BYTES", "PROBE_ROUNDS",
           "choose_grain", "probe_rate"]

# The probe: a float32 key of this size (above MXNet's big-array bound, so spread over every
# server as a 4 MiB sub-key is), one push+pull to warm up, then the best of PROBE_ROUNDS.
PROBE_BYTES = 8 * 1024**2
PROBE_ROUNDS = 5


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
