"""Configuration: keyword arguments override environment variables, which override defaults.

Sizes are bytes. Strings such as ``"4MB"`` (SI, 4,000,000), ``"4MiB"`` (binary,
4,194,304), ``"512KiB"`` or plain integers are accepted everywhere a size is.

>>> parse_size("512KiB", "partition_bytes")
524288
>>> SchedulerConfig.resolve(partition_bytes="1MB").partition_bytes
1000000
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from .plan import read_plan
from .values import (  # noqa: F401 - the parsers are also this module's (their first home)
    MAX_TIMEOUT,
    SIZE_FORMS,
    Size,
    format_size,
    parse_bool,
    parse_log_level,
    parse_milliseconds,
    parse_nonnegative_size,
    parse_size,
    parse_timeout,
)

ENV_PARTITION = "BYTESCHEDULER_PARTITION"
ENV_CREDIT = "BYTESCHEDULER_CREDIT"
ENV_TIMELINE = "BYTESCHEDULER_TIMELINE"
ENV_DEBUG = "BYTESCHEDULER_DEBUG"
ENV_TIMEOUT = "BYTESCHEDULER_TIMEOUT"
ENV_MERGE = "BYTESCHEDULER_MERGE"
ENV_FAST_LANE = "BYTESCHEDULER_FAST_LANE"
ENV_TUNING = "BYTESCHEDULER_TUNING"
ENV_CYCLE = "BYTESCHEDULER_CYCLE_TIME"
ENV_ADAPTIVE = "BYTESCHEDULER_ADAPTIVE"
ENV_GRAD_VIEWS = "BYTESCHEDULER_GRAD_VIEWS"
ENV_PLAN = "BYTESCHEDULER_PLAN"



@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of the scheduler, in bytes and seconds.

    partition_bytes: tensors larger than this are split into pieces of at most this size,
        and small pieces are merged into operations of at most this size.
    credit_bytes: at most this many bytes are in flight at once (a single piece larger
        than the credit goes out alone when nothing else is in flight).
    merge: fuse small ready pieces of the same dtype/device into one operation.
    fast_lane_bytes: operations of at most this size go to a second communication lane, with
        a window of its own of this many bytes, so an urgent small tensor neither queues behind
        large ones in the backend's FIFO nor waits for a full main credit; 0 turns it off.
        Bytes in flight never exceed ``credit_bytes + fast_lane_bytes``.
    timeout: seconds a communication operation (or a peer it waits for) may take before
        :class:`~bytescheduler.core.errors.CommunicationTimeout` is raised.
    timeline: path of the Chrome trace to write (one file per rank), or None.
    log_level: logging level for the ``bytescheduler`` logger (stderr), or None.
    auto_tune: search partition and credit sizes online from measured step times,
        starting from ``partition_bytes`` and ``credit_bytes`` (see
        :mod:`bytescheduler.core.tuning`); the math is unchanged.
    cycle_ms: how long the deciding rank may hold queued work, waiting for more to merge
        with, while less than ``partition_bytes`` is queued (as Horovod's cycle time). It
        stops holding at once when the adapter signals the end of a burst (the end of
        backward), on flush and on stop, so the last, most urgent tensors are never held.
        On a fast link, where each tensor would otherwise go alone, it saves the fixed cost
        of most operations; 0 launches whatever the credit admits immediately.
    adaptive: let rank 0 time the scheduled path against the framework's own (plain) path
        and run the faster, trying the other again now and then
        (:mod:`bytescheduler.core.modes`); the math is the same either way.
        ScheduledOptimizer (torch and Horovod) turns it on by default; it is off with
        ``auto_tune``, which tunes the scheduled path.
    grad_views: after a bucket of several gradients is averaged in one buffer (the DDP
        hook's buckets, ScheduledOptimizer's plain path), make each large, contiguous
        parameter's ``.grad`` a view of its place in that buffer instead of copying the
        average back, as DDP's ``gradient_as_bucket_view`` does: the same values, one pass
        over the gradients fewer. A ``.grad`` kept from an earlier iteration then shows
        later values; keep a ``.clone()`` (:mod:`bytescheduler.pytorch.grad_views`).
    start_plain: with ``adaptive``, start on the framework's own path and hold it as if the
        mode switch had chosen it (the scheduled path is tried after the hold), instead of
        timing both paths first; what a plan that predicts no gain sets.
    plan: path of a plan written by ``bytescheduler plan`` (:mod:`bytescheduler.core.plan`).
        Its partition, credit and choice to schedule or not (``start_plain``) take the place
        of the adapter's defaults: settings given explicitly (keywords, the environment)
        still win, and ``auto_tune`` starts its search from the plan's setting.
    """

    partition_bytes: int = 4 * 1024**2
    credit_bytes: int = 16 * 1024**2
    merge: bool = True
    fast_lane_bytes: int = 1024**2
    timeout: float = 300.0
    timeline: Optional[str] = None
    log_level: Optional[int] = None
    auto_tune: bool = False
    cycle_ms: float = 0.0
    adaptive: bool = False
    grad_views: bool = True
    start_plain: bool = False
    plan: Optional[str] = None

    @classmethod
    def resolve(cls, environ: Optional[Mapping[str, str]] = None, defaults: Optional["SchedulerConfig"] = None,
                **overrides: Any) -> "SchedulerConfig":
        """Build a config from ``defaults`` (default: the class defaults), then a plan (the
        ``plan`` keyword, else ``BYTESCHEDULER_PLAN``), then ``environ`` (default
        ``os.environ``), then keywords.

        Keywords whose value is None are ignored, so adapters can pass their arguments through.
        """
        env = os.environ if environ is None else environ
        base = defaults if defaults is not None else cls()
        plan = overrides.get("plan") if overrides.get("plan") is not None else env.get(ENV_PLAN) or None
        if plan is not None:
            base = base.with_plan(plan)
        values = {
            field: _PARSERS[field](env[name], name)
            for name, field in _ENVIRONMENT.items()
            # An empty BYTESCHEDULER_DEBUG means "off"; other empty variables are unset.
            if env.get(name) or (name == ENV_DEBUG and name in env)
        }
        values.update(_parse_options(overrides))
        return replace(base, **values)

    @classmethod
    def build(cls, config: Optional["SchedulerConfig"] = None, defaults: Optional["SchedulerConfig"] = None,
              **options: Any) -> "SchedulerConfig":
        """What an adapter runs with: ``config`` as given or, without one, ``defaults`` (the
        adapter's own) read over by the environment; then the keyword ``options`` on top.

        Every adapter takes ``config=None, **options`` and passes them here, so the options
        are defined once, on this class.

        >>> SchedulerConfig.build(SchedulerConfig(credit_bytes=8), partition_bytes="4KiB").credit_bytes
        8
        """
        if config is None:
            return cls.resolve(defaults=defaults, **options)
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a bytescheduler SchedulerConfig, not {type(config).__name__}")
        return config.with_options(**options)

    def with_options(self, **overrides: Any) -> "SchedulerConfig":
        """A copy with the given keywords (None ones ignored) parsed and applied; no environment.
        A ``plan`` is applied first, so the other keywords override it."""
        base = self if overrides.get("plan") is None else self.with_plan(overrides["plan"])
        return replace(base, **_parse_options(overrides))

    def with_plan(self, path: Any) -> "SchedulerConfig":
        """A copy with the settings of the plan in file ``path``: its partition and credit,
        and ``start_plain`` when it says not to schedule.

        >>> import json, tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        ...     json.dump({"format": "bytescheduler-plan", "version": 1, "schedule": False,
        ...                "partition_bytes": 1024, "credit_bytes": 4096}, f)
        >>> config = SchedulerConfig().with_plan(f.name)
        >>> config.partition_bytes, config.credit_bytes, config.start_plain
        (1024, 4096, True)
        >>> os.remove(f.name)
        """

        plan = read_plan(path)
        return replace(self, plan=os.fspath(path), partition_bytes=plan.partition_bytes,
                       credit_bytes=plan.credit_bytes, start_plain=not plan.schedule)


# Sub-keys in flight per parameter server under the credit (server_grain_bytes).
SUBKEYS_PER_SERVER = 8


def server_grain_bytes(servers: int, credit_bytes: int = 64 * 1024**2) -> int:
    """ScheduledKVStore's default partition (and server grain) for ``servers`` parameter servers.

    A sub-key below MXNet's big-array bound (1,000,000 elements: any grain up to 2 MiB of
    float32) lives whole on one server, chosen by MXNet's key hash, so under a credit of
    ``credit_bytes`` about ``credit_bytes / grain`` sub-keys are in flight, a few per server:
    with too few, some servers' links idle while others queue; each sub-key also costs a
    request. The grain is the largest power of two that keeps eight per server in flight,
    4 MiB at most (the size measured best on 2 servers; a 4 MiB sub-key is above the bound
    and MXNet spreads it over every server) and 256 KiB at least (docs/simulator.md, "The
    grain and the number of servers").

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

    Sub-keys cost a request and a server update each per step and win where the link is slow
    (the servers return a large layer's first parts while the rest is pushed): on 2 servers
    4 MiB ones measured 0.99-1.09x of ``dist_sync`` at 1 Gbit/s and 0.92x on CPU-bound
    loopback, where whole keys measured 0.98x and 1.01-1.03x. Whole keys (:data:`COARSE_GRAIN_BYTES`, every key of the bench's
    models) only on 1-2 servers: from 4 servers on, the simulator predicts grains finer than
    4 MiB winning even at 12.6 Gbit/s (docs/simulator.md, "The grain and the number of servers").

    >>> [choose_grain(rate, servers) // 1024 for rate, servers in ((100e6, 2), (400e6, 2), (400e6, 8))]
    [4096, 65536, 1024]
    """
    if rate >= FAST_LINK_BYTES_PER_S and servers <= COARSE_SERVERS:
        return COARSE_GRAIN_BYTES
    return server_grain_bytes(servers, credit_bytes)


_PARSERS = {
    "partition_bytes": parse_size,
    "credit_bytes": parse_size,
    "fast_lane_bytes": parse_nonnegative_size,
    "merge": parse_bool,
    "auto_tune": parse_bool,
    "timeout": parse_timeout,
    "log_level": parse_log_level,
    "timeline": lambda value, name: os.fspath(value),
    "cycle_ms": parse_milliseconds,
    "adaptive": parse_bool,
    "grad_views": parse_bool,
    "start_plain": parse_bool,
    "plan": lambda value, name: os.fspath(value),
}


_ENVIRONMENT = {
    ENV_PARTITION: "partition_bytes",
    ENV_CREDIT: "credit_bytes",
    ENV_MERGE: "merge",
    ENV_FAST_LANE: "fast_lane_bytes",
    ENV_TIMEOUT: "timeout",
    ENV_TIMELINE: "timeline",
    ENV_DEBUG: "log_level",
    ENV_TUNING: "auto_tune",
    ENV_CYCLE: "cycle_ms",
    ENV_ADAPTIVE: "adaptive",
    ENV_GRAD_VIEWS: "grad_views",
    ENV_PLAN: "plan",
}


# field -> its environment variable, for messages.
ENVIRONMENT_OF = {field: name for name, field in _ENVIRONMENT.items()}


def _parse_options(overrides: Mapping[str, Any]) -> dict:
    unknown = sorted(set(overrides) - set(_PARSERS))
    if unknown:
        hints = [f"{close[0]!r} for {name!r}" for name in unknown
                 for close in [difflib.get_close_matches(name, _PARSERS, n=1, cutoff=0.5)] if close]
        raise TypeError(f"unknown scheduler option(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                        + f"; use one of {sorted(_PARSERS)}")
    return {name: _PARSERS[name](value, name) for name, value in overrides.items() if value is not None}
