"""A discrete-event simulation of data-parallel training iterations on N ranks.

Every rank computes alike and has a link of the same rate, so one rank is simulated: its
training thread (:mod:`~bytescheduler_tools.sim.training`), its communication threads and its
link, with the CPU of its core(s) and its link shared max-min fair among what runs
(:mod:`~bytescheduler_tools.sim.fluid`). Systems (the bench's names; ``mxnet`` and
``mxnet-scheduled`` are the ``ps`` ones):

* ``compute``: forward, backward and step, no communication.
* ``ddp``: DDP's buckets over gloo (:mod:`~bytescheduler_tools.sim.allreduce`).
* ``ddp-hook``: the same buckets through the scheduled hook and the real policy.
* ``scheduled``: ScheduledOptimizer over gloo: every gradient through the real policy,
  updates as gradients arrive, each layer's next forward waiting for its own.
* ``hvd``: Horovod's DistributedOptimizer: its background thread's cycle, negotiation and
  tensor fusion (:mod:`~bytescheduler_tools.sim.horovod`).
* ``hvd-scheduled``: ScheduledOptimizer over Horovod: the policy's operations through
  Horovod's thread and cycle, completions seen by our poller.
* ``ps``: MXNet's ``dist_sync`` parameter server as gluon's Trainer uses it
  (:mod:`~bytescheduler_tools.sim.ps`).
* ``ps-scheduled``: ScheduledKVStore: the policy over the same servers, large keys as
  sub-keys spread over them, each block's forward waiting for its own pulls.

The scheduled systems run the runtime's own :class:`~bytescheduler.core.policy.SchedulingPolicy`
with simulated time (:mod:`~bytescheduler_tools.sim.scheduling`): the simulator never
re-implements a scheduling rule. They also have a mode switch (``adaptive``): the result
holds the prediction of the framework's own path too (``plain_seconds``), and which the
switch would run (``chosen_seconds``).

With a :class:`~bytescheduler_tools.sim.calibration.Calibration`, communication, our threads and
the updater cost CPU on the rank's core(s), measured per operation and per byte; without
one they cost none and every thread has a core of its own. Left out: stragglers, jitter,
and ranks that differ.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.grain import choose_grain, server_grain_bytes
from .allreduce import LINK, DdpReducer, GlooLanes, ScheduledAllReduce, ScheduledHook, ddp_buckets
from .calibration import Calibration
from .events import Simulation, Span
from .fluid import CORE
from .network import Network
from .profile import Profile
from .training import StepMode, Training, gradients

__all__ = ["SYSTEMS", "ALIASES", "Result", "simulate", "default_config", "network_defaults", "server_count", "canonical", "gradients", "ddp_buckets"]

SYSTEMS = ("compute", "ddp", "ddp-hook", "scheduled", "hvd", "hvd-scheduled", "ps", "ps-scheduled")
# The bench's names for the parameter-server systems, so predictions and measurements line up.
ALIASES = {"mxnet": "ps", "mxnet-scheduled": "ps-scheduled"}
SYSTEM_NAMES = SYSTEMS + tuple(ALIASES)
# Each scheduled system's framework path: what its mode switch runs instead.
PLAIN_PATHS = {"ddp-hook": "ddp-hook:plain", "scheduled": "ddp", "hvd-scheduled": "hvd", "ps-scheduled": "ps-scheduled:plain"}
# The mode switch keeps the framework's path unless the schedule is faster by more than this.
SWITCH_MARGIN = 0.01


@dataclass(frozen=True)
class Result:
    """One system's prediction.

    seconds: per iteration in steady state (for a scheduled system: on the scheduled path).
    link_busy: share of that time the link carried data.
    operations: launched per iteration.
    plain_seconds: for a scheduled system with ``adaptive``: its framework path's seconds.
    core_busy: share of the core(s) in use (with a calibration; 0 without).
    spans: the last iterations' phases per thread (``record=True``), for a Gantt chart.
    """

    system: str
    seconds: float
    link_busy: float
    operations: float
    plain_seconds: Optional[float] = None
    core_busy: float = 0.0
    spans: Tuple[Span, ...] = field(default=(), repr=False, compare=False)
    iteration_starts: Tuple[float, ...] = field(default=(), repr=False, compare=False)

    @property
    def chosen_path(self) -> str:
        """The path the mode switch would run: the schedule only when it is more than 1% faster.

        >>> Result("scheduled", 1.0, 0.5, 10, plain_seconds=1.0).chosen_path
        'framework'
        """
        if self.plain_seconds is None or self.seconds < self.plain_seconds * (1 - SWITCH_MARGIN):
            return "scheduled"
        return "framework"

    @property
    def chosen_seconds(self) -> float:
        """The seconds per iteration of :attr:`chosen_path`."""
        return self.seconds if self.chosen_path == "scheduled" or self.plain_seconds is None else self.plain_seconds


def canonical(system: str) -> str:
    """The simulator's name of ``system`` (the bench's names are accepted too)."""
    name = ALIASES.get(system, system)
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}: use one of {', '.join(SYSTEM_NAMES)}")
    return name


def default_config(system: str, servers: Optional[int] = None, bandwidth: Optional[float] = None) -> SchedulerConfig:
    """The settings an adapter uses when the user sets none (kept equal to the adapters' by a
    test); ``servers``: the parameter servers of the ``ps`` systems, whose default partition
    follows their number (None: ScheduledKVStore's default on 1-2 servers, 4 MiB);
    ``bandwidth``: the link's rate in bytes per second, which ScheduledKVStore's probe
    measures at its first ``init`` to choose its grain (:func:`~bytescheduler.core.grain.choose_grain`;
    None: the grain before the probe, ``server_grain_bytes``)."""
    system = canonical(system)
    if system == "ddp-hook":
        return SchedulerConfig(partition_bytes=64 * 1024**2, credit_bytes=256 * 1024**2, adaptive=True)
    if system == "hvd-scheduled":
        # Horovod fuses by itself: the adapter turns merging off.
        return SchedulerConfig(partition_bytes=8 * 1024**2, credit_bytes=16 * 1024**2, adaptive=True)
    if system == "ps-scheduled":
        # ps-lite sends every server key as a request of its own: the store turns merging off.
        credit = 64 * 1024**2
        grain = server_grain_bytes(servers or 1, credit) if bandwidth is None else \
            choose_grain(bandwidth, servers or 1, credit)
        return SchedulerConfig(partition_bytes=grain, credit_bytes=credit, adaptive=True)
    return SchedulerConfig(cycle_ms=2.0, adaptive=True)


def network_defaults(system: str, network: Network, ranks: int) -> SchedulerConfig:
    """:func:`default_config` of ``system`` on ``ranks`` ranks joined by ``network``."""
    return default_config(system, servers=server_count(network, ranks), bandwidth=network.bandwidth)


def server_count(network: Network, ranks: int) -> int:
    """The parameter servers of a ``ps`` simulation: one on each rank's machine, or the network's."""
    return network.servers or ranks


def _capacities(calibration: Optional[Calibration]) -> Dict[str, float]:
    return {CORE: float(calibration.cores) if calibration is not None else math.inf, LINK: 1.0}


def _build(sim: Simulation, profile: Profile, network: Network, ranks: int, system: str,
           config: SchedulerConfig, calibration: Optional[Calibration]) -> Training:
    """The rank's training thread wired to ``system``'s communication."""
    if system in ("hvd", "hvd-scheduled"):
        from .horovod import build as build_horovod

        return build_horovod(sim, profile, network, ranks, system, config, calibration)
    if system.startswith("ps"):
        from .ps import build as build_ps

        return build_ps(sim, profile, network, ranks, system, config, calibration)
    lanes = GlooLanes(sim, network, ranks, calibration)
    if system == "ddp":
        return Training(sim, profile, StepMode.WAIT, DdpReducer(lanes, profile, calibration))
    if system == "ddp-hook:plain":  # DDP's all-reduce of each bucket, issued in the hook
        return Training(sim, profile, StepMode.WAIT, DdpReducer(lanes, profile, calibration, divide=True))
    if system == "ddp-hook":
        return Training(sim, profile, StepMode.WAIT, ScheduledHook(lanes, profile, calibration, config, sim))
    if system == "scheduled":
        return Training(sim, profile, StepMode.OVERLAP, ScheduledAllReduce(lanes, calibration, config, sim))
    raise ValueError(f"unknown system {system!r}")


def _run(profile: Profile, network: Network, ranks: int, system: str, config: SchedulerConfig,
         iterations: int, calibration: Optional[Calibration], record: bool) -> Result:
    sim = Simulation(_capacities(calibration), record=record)
    training = _build(sim, profile, network, ranks, system, config, calibration)
    launched: List[int] = []
    training.on_iteration.append(lambda now: launched.append(training.comm.operations))
    training.start()
    sim.run_until(lambda: len(training.starts) > iterations)
    starts = training.starts
    seconds = _steady(starts)
    elapsed = starts[-1] or 1.0
    window = (starts[-3] if len(starts) >= 3 else 0.0, starts[-1])
    spans = tuple(s for s in sim.spans if s.end > window[0] and s.start < window[1]) if record else ()
    core_busy = sim.busy(CORE) / elapsed / calibration.cores if calibration is not None else 0.0
    link = sim.busy("up@0") if system.startswith("ps") else sim.busy(LINK)
    return Result(system, seconds, min(1.0, link / elapsed), _steady([float(n) for n in launched]),
                  core_busy=min(1.0, core_busy), spans=spans, iteration_starts=tuple(starts))


def simulate(profile: Profile, network: Network, ranks: int, system: str,
             config: Optional[SchedulerConfig] = None, iterations: int = 8,
             calibration: Optional[Calibration] = None, record: bool = False) -> Result:
    """Seconds per iteration of ``system`` in steady state (the mean of the last half of the iterations).

    ``config``: the scheduler's settings for the scheduled systems (default: the adapter's
    defaults, :func:`default_config`). ``calibration``: measured costs of communication and
    CPU (see :mod:`bytescheduler_tools.sim.calibration`); None leaves CPU out. ``record``: keep
    the last two iterations' phases in ``Result.spans`` (for :mod:`bytescheduler_tools.sim.gantt`).

    >>> from bytescheduler_tools.sim.profile import Layer, Tensor
    >>> profile = Profile("one", (Layer("x", 0.05, (Tensor(2_000_000, 0.2),)),), backward_s=0.2, step_s=0.01)
    >>> round(simulate(profile, Network(bandwidth=1e7, latency=0.0), 2, "ddp").seconds, 3)  # 0.05 + 0.2 + 0.2 + 0.01
    0.46
    """
    name = canonical(system)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if iterations < 2:
        raise ValueError(f"iterations must be at least 2 (a steady state needs two starts), not {iterations}")
    if name == "compute":
        return Result(system, profile.compute_s, 0.0, 0.0, iteration_starts=())
    if config is None:
        config = network_defaults(name, network, ranks)
    result = _run(profile, network, ranks, name, config, iterations, calibration, record)
    plain = None
    if name in PLAIN_PATHS and config.adaptive and not config.auto_tune:
        plain = _plain_seconds(profile, network, ranks, name, iterations, calibration)
    return Result(system, result.seconds, result.link_busy, result.operations, plain, result.core_busy,
                  result.spans, result.iteration_starts)


# The framework path does not depend on the scheduler's settings: a planner's grid of
# partitions and credits needs it once. Keyed by everything it does depend on.
_PLAIN_CACHE: "OrderedDict[tuple, float]" = OrderedDict()
_PLAIN_CACHE_SIZE = 256


def _plain_seconds(profile: Profile, network: Network, ranks: int, system: str, iterations: int,
                   calibration: Optional[Calibration]) -> float:
    costs = None if calibration is None else (tuple(sorted(calibration.backends.items())),
                                               calibration.memcpy_bytes_per_s, calibration.cores)
    key = (profile, network, ranks, system, iterations, costs)
    if key not in _PLAIN_CACHE:
        _PLAIN_CACHE[key] = _run(profile, network, ranks, PLAIN_PATHS[system],
                                 network_defaults(system, network, ranks), iterations, calibration, False).seconds
        if len(_PLAIN_CACHE) > _PLAIN_CACHE_SIZE:
            _PLAIN_CACHE.popitem(last=False)
    return _PLAIN_CACHE[key]


def _steady(starts: List[float]) -> float:
    """The mean step of a rising series over its second half (the steady state)."""
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    tail = gaps[len(gaps) // 2:] or gaps
    return sum(tail) / len(tail) if tail else 0.0
