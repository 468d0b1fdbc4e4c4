"""A parameter server's grain: the size of the sub-keys a scheduled store splits large keys into.

Pure arithmetic of sizes and server counts, shared by :mod:`bytescheduler.mxnet` (which
probes the link and applies it) and the simulator (which applies it to a simulated link).

>>> server_grain_bytes(2) // 1024, choose_grain(400e6, 2) // 1024
(4096, 65536)
"""

from __future__ import annotations

# Sub-keys in flight per parameter server under the credit (server_grain_bytes).
SUBKEYS_PER_SERVER = 8


def server_grain_bytes(servers: int, credit_bytes: int = 64 * 1024**2) -> int:
    """ScheduledKVStore's default partition (and server grain) for ``servers`` parameter servers.

    A sub-key below MXNet's big-array bound (1,000,000 elements: any grain up to 2 MiB of
    float32) lives whole on one server, chosen by MXNet's key hash, so under a credit of
    ``credit_bytes`` about ``credit_bytes / grain`` sub-keys are in flight, a few per server:
    with too few, some servers' links idle while others queue; each sub-key also costs a
    request. The grain is the largest power of two that keeps eight per server in flight,
    4 MiB at most (the best size on 2 servers; a 4 MiB sub-key is above the bound and MXNet
    spreads it over every server) and 256 KiB at least (docs/simulator.md, "The grain and
    the number of servers").

    >>> [server_grain_bytes(n) // 1024 for n in (1, 2, 4, 8, 16, 32, 64, 256)]
    [4096, 4096, 2048, 1024, 512, 256, 256, 256]
    """
    if servers < 1:
        raise ValueError(f"servers must be at least 1, not {servers}")
    share = max(1, credit_bytes // (SUBKEYS_PER_SERVER * servers))
    return max(256 * 1024, min(4 * 1024**2, 1 << (share.bit_length() - 1)))


# ScheduledKVStore's grain when none is given (bytescheduler/mxnet/grain.py probes the link
# for it; the simulator uses the simulated link's rate): whole keys at or above this push+pull
# rate (bytes of the key per second) on at most COARSE_SERVERS servers, else sub-keys of
# server_grain_bytes.
FAST_LINK_BYTES_PER_S = 250 * 1000**2
COARSE_GRAIN_BYTES = 64 * 1024**2
COARSE_SERVERS = 2


def choose_grain(rate: float, servers: int, credit_bytes: int = 64 * 1024**2) -> int:
    """ScheduledKVStore's server grain for a link whose push+pull runs at ``rate`` bytes per
    second, with ``servers`` servers.

    Sub-keys cost a request and a server update each per step and win where the link is
    slow (the servers return a large layer's first parts while the rest is pushed); on a
    fast link that cost is all they bring. So: whole keys (:data:`COARSE_GRAIN_BYTES`, every
    key of the bench's models) at :data:`FAST_LINK_BYTES_PER_S` or more on at most
    :data:`COARSE_SERVERS` servers, else :func:`server_grain_bytes`: on more servers a finer
    grain spreads the load even on a fast link (docs/mxnet.md and docs/simulator.md, "The
    grain and the number of servers", have the measurements).

    >>> [choose_grain(rate, servers) // 1024 for rate, servers in ((100e6, 2), (400e6, 2), (400e6, 8))]
    [4096, 65536, 1024]
    """
    if rate >= FAST_LINK_BYTES_PER_S and servers <= COARSE_SERVERS:
        return COARSE_GRAIN_BYTES
    return server_grain_bytes(servers, credit_bytes)
