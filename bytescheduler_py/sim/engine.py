"""A discrete-event simulation of data-parallel training iterations on N ranks.

Every rank computes alike and has a link of the same rate, so one rank is simulated: its
compute (from a :class:`~bytescheduler.sim.profile.Profile`) and the backend's lanes,
each a first-in-first-out queue of all-reduce operations; the operations at the heads of
busy lanes share the link equally. An operation's cost is the
:class:`~bytescheduler.sim.network.Network`'s all-reduce time for N ranks.

Systems:

* ``compute``: forward, backward and step, no communication.
* ``ddp``: DDP's buckets (the first of 1 MiB, then 25 MiB, in reverse parameter order),
  each all-reduced once all its gradients are ready and the buckets before it were
  launched; the step waits for every bucket.
* ``ddp-hook``: the same buckets through the scheduled hook: the real
  :class:`~bytescheduler.core.policy.SchedulingPolicy` decides which pieces go when.
* ``scheduled``: ScheduledOptimizer: each gradient goes through the real policy as soon as
  it is ready, ``step()`` returns at once, the update of each layer follows its
  communication (on one updater, the step's time shared by bytes), and the next forward
  of a layer waits only for that layer's update.

The scheduled systems run the runtime's own policy object with simulated time: the
simulator never re-implements a scheduling rule. Left out: the CPU the scheduler, the
backend's threads and the updater take from the training thread (large on a one-core
rank; see docs/benchmarks.md), stragglers and jitter.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..core.config import SchedulerConfig
from ..core.policy import SchedulingPolicy
from ..core.task import Operation, Task
from .network import Network
from .profile import Profile

SYSTEMS = ("compute", "ddp", "ddp-hook", "scheduled")
# DDP's defaults: the first bucket is small so that communication starts early.
FIRST_BUCKET_BYTES = 1024**2
BUCKET_BYTES = 25 * 1024**2
LANES = 2  # the torch backend's: a main lane and the fast lane


@dataclass(frozen=True)
class Result:
    system: str
    seconds: float  # per iteration, steady state
    link_busy: float  # share of that time the link carried data
    operations: float  # per iteration


@dataclass(frozen=True)
class _Gradient:
    key: int
    nbytes: int
    ready_s: float  # after backward starts
    priority: int  # forward order of its first parameter (lower goes first)
    layers: Tuple[int, ...]  # layers whose parameters it carries


def gradients(profile: Profile) -> List[_Gradient]:
    """Every parameter's gradient, in forward order."""
    out = []
    for index, layer in enumerate(profile.layers):
        for tensor in layer.tensors:
            out.append(_Gradient(len(out), tensor.nbytes, tensor.ready_s, len(out), (index,)))
    return out


def ddp_buckets(profile: Profile) -> List[_Gradient]:
    """DDP's buckets in launch order: parameters in reverse order, closed once at their cap."""
    buckets: List[List[_Gradient]] = [[]]
    cap = FIRST_BUCKET_BYTES
    for grad in reversed(gradients(profile)):
        buckets[-1].append(grad)
        if sum(g.nbytes for g in buckets[-1]) >= cap:
            buckets.append([])
            cap = BUCKET_BYTES
    out = []
    ready = 0.0
    for members in (b for b in buckets if b):
        ready = max(ready, max(g.ready_s for g in members))  # DDP hands buckets over in order
        out.append(_Gradient(len(out), sum(g.nbytes for g in members), ready, min(g.priority for g in members),
                             tuple(sorted({layer for g in members for layer in g.layers}))))
    return out


class Link:
    """The backend's lanes on one link: each lane runs its operations one at a time, in order;
    the operations running on busy lanes share the link's rate equally."""

    def __init__(self, lanes: int) -> None:
        self.queues: List[List[Tuple[float, Callable[[float], None]]]] = [[] for _ in range(lanes)]
        self.left: List[float] = [0.0] * lanes  # seconds at full rate left of each head
        self.now = 0.0
        self.busy = 0.0  # seconds the link carried something

    def _active(self) -> List[int]:
        return [lane for lane, queue in enumerate(self.queues) if queue]

    def advance(self, until: float) -> List[Tuple[float, Callable[[float], None]]]:
        """Run the link up to ``until``; return (finish time, callback) of every operation that ended."""
        ended = []
        while True:
            active = self._active()
            if not active:
                self.now = until
                return ended
            share = len(active)
            step = min(self.left[lane] for lane in active) * share
            if self.now + step > until:
                for lane in active:
                    self.left[lane] -= (until - self.now) / share
                self.busy += until - self.now
                self.now = until
                return ended
            self.now += step
            self.busy += step
            for lane in active:
                self.left[lane] -= step / share
                if self.left[lane] <= 1e-15:
                    _, done = self.queues[lane].pop(0)
                    ended.append((self.now, done))
                    self.left[lane] = self.queues[lane][0][0] if self.queues[lane] else 0.0

    def next_end(self) -> Optional[float]:
        active = self._active()
        if not active:
            return None
        return self.now + min(self.left[lane] for lane in active) * len(active)

    def launch(self, lane: int, seconds: float, done: Callable[[float], None]) -> None:
        """Queue an operation of ``seconds`` (at the full rate) on ``lane`` (call after :meth:`advance`)."""
        queue = self.queues[lane]
        queue.append((seconds, done))
        if len(queue) == 1:
            self.left[lane] = seconds


class _Run:
    """One simulated run of a system: events in time order, the link, the policy."""

    def __init__(self, profile: Profile, network: Network, ranks: int, config: SchedulerConfig, overlap: bool,
                 units: List[_Gradient]) -> None:
        self.profile = profile
        self.network = network
        self.ranks = ranks
        self.overlap = overlap
        self.units = units
        self.policy = SchedulingPolicy(config.partition_bytes, config.credit_bytes, config.merge,
                                       config.fast_lane_bytes, LANES, config.cycle_ms / 1000.0)
        self.link = Link(LANES)
        self._events: List[Tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self.operations = 0
        total = profile.gradient_bytes or 1
        self._update_s = {u.key: profile.step_s * u.nbytes / total for u in units}
        self._updater_free = 0.0
        self._done_bytes: Dict[int, int] = {}
        self._pending: Dict[int, int] = {}  # layer -> gradients not yet updated
        self._layer_ready = [0.0] * len(profile.layers)  # when each layer's parameters are up to date
        self._waiting: Optional[Tuple[int, float]] = None  # forward stopped at (layer, its start)
        self.starts: List[float] = []
        self.launched: List[int] = []  # operations launched when each iteration started

    def at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self, iterations: int) -> None:
        self.at(0.0, lambda now: self._forward(0, now))
        while len(self.starts) <= iterations:
            when = self._events[0][0] if self._events else None
            end = self.link.next_end()
            if end is None and when is None:
                raise RuntimeError("simulation stalled: nothing to compute and nothing on the link")
            if end is not None and (when is None or end <= when):
                for finish, done in self.link.advance(end):
                    done(finish)
                continue
            _, _, action = heapq.heappop(self._events)
            for finish, done in self.link.advance(when):
                done(finish)
            action(when)
            self._launch(when)
        self.finish_time = self.link.now

    # ------------------------------------------------------------------ compute

    def _forward(self, layer: int, now: float) -> None:
        layers = self.profile.layers
        while layer < len(layers):
            if self._pending.get(layer):
                self._waiting = (layer, now)
                return
            begin = max(now, self._layer_ready[layer])
            if layer == 0:
                self.starts.append(begin)
                self.launched.append(self.operations)
            now = begin + layers[layer].forward_s
            layer += 1
        self.at(now, self._backward)

    def _backward(self, now: float) -> None:
        for unit in self.units:
            for layer in unit.layers:
                self._pending[layer] = self._pending.get(layer, 0) + 1
            self.at(now + unit.ready_s, lambda t, unit=unit: self._ready(unit, t))
        self.at(now + self.profile.backward_s, self._end_of_backward)

    def _end_of_backward(self, now: float) -> None:
        self.policy.end_burst()
        if self.overlap:  # step() returns at once; each layer's forward waits for its own update
            self._forward(0, now)
        elif not any(self._pending.values()):
            self._forward(0, now + self.profile.step_s)
        else:
            self._waiting = (-1, now)

    # ------------------------------------------------------------------ communication

    def _ready(self, unit: _Gradient, now: float) -> None:
        task = Task(key=unit.key, numel=max(1, unit.nbytes // 4), itemsize=4, priority=unit.priority, payload=unit,
                    fuse_key="f32")
        self._done_bytes[unit.key] = 0
        self.policy.add(task, now)

    def _launch(self, now: float) -> None:
        for op in self.policy.decide(now):
            self.operations += 1
            seconds = self.network.allreduce_seconds(op.nbytes, self.ranks)
            self.link.launch(op.lane, seconds, lambda t, op=op: self._finished(op, t))
        hold = self.policy.hold_remaining(now)
        if hold > 0:
            self.at(now + hold, lambda t: None)  # wake up when the hold ends (the loop then launches)

    def _finished(self, op: Operation, now: float) -> None:
        self.policy.finished(op)
        for piece in op.pieces:
            unit = piece.task.payload
            self._done_bytes[unit.key] += piece.nbytes
            if self._done_bytes[unit.key] == piece.task.nbytes:
                self._update(unit, now)
        self._launch(now)

    def _update(self, unit: _Gradient, now: float) -> None:
        if self.overlap:
            self._updater_free = max(self._updater_free, now) + self._update_s[unit.key]
            done = self._updater_free
        else:
            done = now
        for layer in unit.layers:
            self._pending[layer] -= 1
            self._layer_ready[layer] = max(self._layer_ready[layer], done)
        if self._waiting is None:
            return
        layer, since = self._waiting
        if layer == -1 and not any(self._pending.values()):
            self._waiting = None
            self.at(max(since, now) + self.profile.step_s, lambda t: self._forward(0, t))
        elif layer >= 0 and not self._pending.get(layer):
            self._waiting = None
            self.at(max(since, self._layer_ready[layer]), lambda t, layer=layer: self._forward(layer, t))


def _ddp(profile: Profile, network: Network, ranks: int, iterations: int) -> Tuple[List[float], float, int]:
    """DDP in closed form: buckets launched in order as they become ready, one lane."""
    buckets = ddp_buckets(profile)
    starts, now, link_free, busy = [], 0.0, 0.0, 0.0
    for _ in range(iterations + 1):
        starts.append(now)
        backward = now + profile.forward_s
        for bucket in buckets:
            seconds = network.allreduce_seconds(bucket.nbytes, ranks)
            link_free = max(link_free, backward + bucket.ready_s) + seconds
            busy += seconds
        now = max(backward + profile.backward_s, link_free) + profile.step_s
    return starts, busy, len(buckets)


def simulate(profile: Profile, network: Network, ranks: int, system: str,
             config: Optional[SchedulerConfig] = None, iterations: int = 8) -> Result:
    """Seconds per iteration of ``system`` in steady state (the mean of the last half of the iterations).

    ``config``: the scheduler's settings for the scheduled systems (default: the adapter's
    defaults, as ``bytescheduler.pytorch`` uses them).
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}: use one of {', '.join(SYSTEMS)}")
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if system == "compute":
        return Result(system, profile.compute_s, 0.0, 0.0)
    if system == "ddp":
        starts, busy, ops = _ddp(profile, network, ranks, iterations)
        seconds = _steady(starts)
        return Result(system, seconds, min(1.0, busy / (iterations + 1) / seconds) if seconds else 0.0, ops)
    if config is None:
        config = default_config(system)
    overlap = system == "scheduled"
    units = gradients(profile) if overlap else ddp_buckets(profile)
    run = _Run(profile, network, ranks, config, overlap, units)
    run.run(iterations)
    seconds = _steady(run.starts)
    return Result(system, seconds, min(1.0, run.link.busy / (run.starts[-1] or 1.0)),  # over the whole run
                  _steady(run.launched))


def default_config(system: str) -> SchedulerConfig:
    """The settings an adapter uses when the user sets none (kept equal to the adapters' by a test)."""
    if system == "ddp-hook":
        return SchedulerConfig(partition_bytes=64 * 1024**2, credit_bytes=256 * 1024**2, adaptive=True)
    # adaptive: the runtime may run the plain (DDP-like) path instead; this engine simulates
    # the scheduled path, and the plain one is the "ddp" system.
    return SchedulerConfig(cycle_ms=2.0, adaptive=True)


def _steady(starts: List[float]) -> float:
    """The mean step of a rising series over its second half (the steady state)."""
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    tail = gaps[len(gaps) // 2:] or gaps
    return sum(tail) / len(tail) if tail else 0.0
