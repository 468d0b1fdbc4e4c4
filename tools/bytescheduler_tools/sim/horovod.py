"""Horovod 0.28.1 in simulated time: one background thread, its cycle, negotiation and tensor fusion.

What Horovod does, read in its source (github.com/horovod/horovod, tag v0.28.1):

* ``horovod/common/operations.cc``, ``BackgroundThreadLoop`` and ``RunLoopOnce``: ONE
  background thread runs a loop; each turn first sleeps until ``HOROVOD_CYCLE_TIME`` has
  passed since the last turn began (default 1 ms: ``SetCycleTimeMs(1)``; no sleep when the
  turn took longer), then computes the responses and performs them one after another on
  that same thread (``PerformOperation``).
* ``horovod/common/controller.cc``, ``ComputeResponseList``: the requests queued since
  the last turn are taken; with the response cache on (default capacity 1024,
  ``global_state.h``; from the second iteration on every gradient's response is cached),
  every rank's cache hits are intersected by one small all-reduce each turn
  (``CoordinateCacheAndState`` -> ``CacheCoordinator::sync`` ->
  ``CrossRankBitwiseAnd``, ``response_cache.cc``), done even when nothing is queued: only
  tensors every rank has queued go. ``FuseResponses`` then packs them, in order, into
  responses of at most the fusion threshold (default 128 MiB:
  ``SetTensorFusionThresholdBytes(128 * 1024 * 1024)`` in ``operations.cc``).
* ``horovod/common/ops/gloo_operations.cc``, ``GlooAllreduce::Execute``: a response of
  several tensors is copied into the fusion buffer (``MemcpyInFusionBuffer``), a single
  tensor into its output buffer; then gloo's all-reduce; then the averaging pass
  (``ScaleBuffer`` with the post-scale factor); then, for several tensors, the copy out of
  the fusion buffer (``MemcpyOutFusionBuffer``): one after another on the background
  thread, so the link idles during the copies and the averaging. (A single tensor reduced
  in place is "copied" onto itself, which glibc's ``memcpy`` skips.)

Every rank queues the same tensors at about the same moments (ranks compute alike), so a
tensor is queued on every rank when it is queued here. The per-turn negotiation costs one
small all-reduce's fixed wait and, with a calibration, the CPU Horovod was measured to burn
per second with nothing to do; each operation costs Horovod's measured CPU per operation
and per byte, its averaging pass (and, fused, its copies in and out) as passes of their
own at the measured copy rate.

Systems:

* ``hvd``, ``hvd.DistributedOptimizer``: each gradient's hook queues its all-reduce; ``step()``
  waits for all (``synchronize``), then the optimizer steps on the training thread.
* ``hvd-scheduled``, bytescheduler's ScheduledOptimizer over it: rank 0's policy (with the
  adapter's defaults: 8 MiB pieces, a 16 MiB credit, no merging, one lane) decides; the
  dispatcher queues each piece's all-reduce with Horovod; our poller thread learns
  completions by polling the oldest operation, sleeping 10 us doubling to 1 ms between
  polls while nothing completes (``bytescheduler/pytorch/horovod.py``,
  ``HorovodBackend._poll``); updates follow as in ScheduledOptimizer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Callable, Deque, List, Optional, Tuple

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.task import Operation
from .allreduce import allreduce_phases
from .calibration import BackendCosts, Calibration
from .events import Phase, Simulation, Thread, Wait, cpu
from .network import Network
from .profile import Profile
from .scheduling import PolicyDriver, ScheduledCommunication
from .training import Communication, Gradient, StepMode, Training

CYCLE_SECONDS = 1e-3  # HOROVOD_CYCLE_TIME's default in 0.28.1
FUSION_BYTES = 128 * 1024**2  # HOROVOD_FUSION_THRESHOLD's default in 0.28.1
# bytescheduler's poller (pytorch/horovod.py): first pause, and the longest.
POLL_FIRST_SECONDS = 1e-5
POLL_LONGEST_SECONDS = 1e-3

Done = Callable[[float], None]


class HorovodThread:
    """Horovod's background thread: a turn every cycle, requests fused and run in order.

    It turns from the start, forever, as Horovod's does (every turn negotiates, also with
    nothing queued, and costs CPU).

    >>> sim = Simulation({"link": 1.0})
    >>> horovod = HorovodThread(sim, Network(bandwidth=1e6, latency=0.0), 2, calibration=None)
    >>> done = []
    >>> sim.at(0.0005, lambda now: [horovod.enqueue(500_000, done.append) for _ in range(2)])
    >>> sim.run_until(lambda: len(done) == 2); done, horovod.operations  # fused at the turn at 1 ms
    ([1.001, 1.001], 1)
    """

    def __init__(self, sim: Simulation, network: Network, ranks: int, calibration: Optional[Calibration],
                 cycle_seconds: float = CYCLE_SECONDS, fusion_bytes: int = FUSION_BYTES) -> None:
        self.sim = sim
        self.network = network
        self.ranks = ranks
        self.calibration = calibration
        self.costs: Optional[BackendCosts] = calibration.backend("horovod") if calibration is not None else None
        self.cycle_seconds = cycle_seconds
        self.fusion_bytes = fusion_bytes
        self.thread = Thread(sim, "horovod")
        self._queue: List[Tuple[int, Done]] = []
        self._turn_began = 0.0
        self.operations = 0  # all-reduces performed (a fused one counts once)
        self.turns = 0
        sim.at(sim.now, self._turn)

    def enqueue(self, nbytes: int, done: Done) -> None:
        """Queue one tensor's all-reduce (``allreduce_async_``); ``done(now)`` when it completed."""
        self._queue.append((nbytes, done))

    def _negotiation(self) -> List[Phase]:
        """One turn's negotiation: a small all-reduce of the cache bits, and the CPU a turn burns."""
        steps = self.network.steps(self.ranks)
        if self.costs is None:
            return [Wait("negotiate", self.network.op_seconds + steps * self.network.latency, "negotiate")]
        burn = self.costs.idle_cpu_per_s * self.cycle_seconds
        fixed = max(0.0, self.costs.op_seconds - burn) + max(0, steps - 2) * self.network.latency
        return [cpu("negotiate", burn, "negotiate"), Wait("negotiate", fixed, "negotiate")]

    def _turn(self, now: float) -> None:
        self._turn_began = now
        self.turns += 1
        taken, self._queue = self._queue, []
        self.thread.run(self._negotiation(), lambda t: self._perform(taken, t))

    def _responses(self, taken: List[Tuple[int, Done]]) -> List[List[Tuple[int, Done]]]:
        """``FuseResponses``: tensors in order, packed while the total stays within the threshold."""
        responses: List[List[Tuple[int, Done]]] = []
        total = 0
        for entry in taken:
            if responses and total + entry[0] <= self.fusion_bytes:
                responses[-1].append(entry)
                total += entry[0]
            else:
                responses.append([entry])
                total = entry[0]
        return responses

    def _perform(self, taken: List[Tuple[int, Done]], now: float) -> None:
        for response in self._responses(taken):
            nbytes = sum(size for size, _ in response)
            self.operations += 1
            self.thread.run(self._execute(nbytes, len(response) > 1),
                            lambda t, response=response: [done(t) for _, done in response])
        self.thread.run([], lambda t: self.sim.at(self._turn_began + self.cycle_seconds, self._turn))

    def _execute(self, nbytes: int, fused: bool) -> List[Phase]:
        """``GlooAllreduce::Execute``, one after another on this thread: (fused) the copy into
        the fusion buffer, gloo's all-reduce, the averaging pass, (fused) the copy out.

        A single tensor is reduced in place: its "copy" into the output is a ``memcpy`` onto
        itself, which glibc returns from at once (``memmove-vec-unaligned-erms.S``: "Source
        == destination is less common"). The calibration's CPU per byte was measured over
        such operations, so it holds the averaging pass; that pass runs here on its own,
        the link idle, and gloo's all-reduce gets the rest.
        """
        if self.calibration is None or self.costs is None:
            return allreduce_phases(self.network, self.ranks, nbytes, self.costs, "all-reduce")
        copy = self.calibration.memcpy_seconds(nbytes)
        averaging = self.calibration.memcpy_seconds(1.0)  # CPU-seconds per byte of a pass over the buffer
        # Horovod's fixed cost is charged per turn (the negotiation); its gloo all-reduces
        # pay the CPU per operation and per byte, and latency only for steps beyond 2 ranks'.
        gloo = replace(self.costs, op_seconds=0.0, cpu_per_byte=max(0.0, self.costs.cpu_per_byte - averaging))
        phases: List[Phase] = [cpu("copy in", copy, "copy")] if fused else []
        phases += allreduce_phases(self.network, self.ranks, nbytes, gloo, "all-reduce")
        phases.append(cpu("average", copy, "copy"))
        if fused:
            phases.append(cpu("copy out", copy, "copy"))
        return phases


class Poller:
    """bytescheduler's completion poller for Horovod: polls the oldest operation in launch
    order, sleeping between polls, 10 us after a completion, doubling to 1 ms otherwise; it
    blocks (and wakes at once) when nothing is in flight."""

    def __init__(self, sim: Simulation, cpu_per_wake: float = 0.0) -> None:
        self.sim = sim
        self.cpu_per_wake = cpu_per_wake
        self.thread = Thread(sim, "poll")
        self._waiting: Deque[List[Any]] = deque()  # [completed at (None: not yet), seen]
        self._pause = POLL_FIRST_SECONDS
        self._sleeping = False

    def watch(self, seen: Done) -> Done:
        """An operation was launched; ``seen(now)`` runs when a poll finds it completed.
        Returns what the backend calls when it completes."""
        entry: List[Any] = [None, seen]
        self._waiting.append(entry)
        if not self._sleeping:
            self._poll(self.sim.now)
        return lambda now: entry.__setitem__(0, now)

    def _poll(self, now: float) -> None:
        if self.cpu_per_wake > 0 and self.thread.idle:  # a poll and a sleep's wake-up
            self.thread.run([cpu("poll", self.cpu_per_wake, "dispatch")])
        finished = 0
        while self._waiting and self._waiting[0][0] is not None:
            _, seen = self._waiting.popleft()
            finished += 1
            seen(now)
        self._pause = POLL_FIRST_SECONDS if finished else min(self._pause * 2, POLL_LONGEST_SECONDS)
        self._sleeping = bool(self._waiting)
        if self._sleeping:
            self.sim.at(now + self._pause, self._poll)


class HorovodAllReduce(Communication):
    """``hvd.DistributedOptimizer``: each gradient's all-reduce queued by its hook."""

    def __init__(self, horovod: HorovodThread) -> None:
        self.horovod = horovod

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        self.horovod.enqueue(grad.nbytes, lambda t, grad=grad: self.training.communicated([grad], t))
        return self.horovod.costs.hook_cpu if self.horovod.costs else 0.0  # the hook's allreduce_async_

    @property
    def operations(self) -> int:
        return self.horovod.operations


class ScheduledHorovod(ScheduledCommunication):
    """ScheduledOptimizer over Horovod: the real policy decides, Horovod's thread moves the
    pieces, the poller learns completions."""

    def __init__(self, sim: Simulation, horovod: HorovodThread, config: SchedulerConfig) -> None:
        self.horovod = horovod
        costs = horovod.costs
        self.poller = Poller(sim, costs.ours_cpu_per_poll if costs else 0.0)
        self.driver = PolicyDriver(sim, config.with_options(merge=False), 1, self._launch, self._done,
                                   cpu_per_op=costs.ours_cpu_per_op if costs else 0.0)

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        self.driver.submit(grad, grad.key, grad.nbytes, grad.key)
        # Our hook; Horovod averages (op=Average), so the hook divides nothing.
        return self.horovod.costs.ours_hook_cpu if self.horovod.costs else 0.0

    def _launch(self, op: Operation, finished: Callable[[float], None]) -> None:
        self.horovod.enqueue(op.nbytes, self.poller.watch(finished))


def build(sim: Simulation, profile: Profile, network: Network, ranks: int, system: str, config: SchedulerConfig,
          calibration: Optional[Calibration]) -> Training:
    """The training thread of ``hvd`` or ``hvd-scheduled``."""
    horovod = HorovodThread(sim, network, ranks, calibration)
    if system == "hvd":
        return Training(sim, profile, StepMode.WAIT, HorovodAllReduce(horovod))
    return Training(sim, profile, StepMode.OVERLAP, ScheduledHorovod(sim, horovod, config))
