"""All-reduce over torch.distributed (gloo): its lanes, DDP's buckets, and the systems built on them.

* :class:`GlooLanes`: each lane is a process group, whose thread runs its all-reduces one
  after another; the operations running on different lanes share the link. An operation
  costs the backend's CPU per operation, then its fixed wait (latency, per message step),
  then its bytes (link time, and CPU per byte: on a one-core rank that CPU is the training
  thread's loss).
* :class:`DdpReducer`: DDP (``ddp``, and the framework's own path of the scheduled adapters):
  each gradient is copied into its bucket (DDP's: reverse parameter order, the first of
  1 MiB, then 25 MiB); a bucket is all-reduced on lane 0 once it is complete and every
  bucket before it was launched; after backward the training thread waits for all of them
  and copies the buckets back into the gradients.
* :class:`ScheduledHook`: DDP + the scheduled hook: the same buckets, divided by the world
  size in the hook, go through rank 0's real policy (:mod:`bytescheduler_tools.sim.scheduling`).
* :class:`ScheduledAllReduce`: ScheduledOptimizer: each gradient, divided in its hook,
  goes through the policy as soon as it is ready; fused pieces are copied into one buffer
  and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.task import Operation
from .calibration import BackendCosts, Calibration
from .events import Phase, Simulation, Thread, Wait, Work, cpu
from .fluid import CORE
from .network import Network
from .profile import Profile
from .scheduling import PolicyDriver, ScheduledCommunication
from .training import Communication, Gradient, gradients

LINK = "link"  # every rank's link, both ways (an all-reduce loads both alike)
# DDP's defaults: the first bucket is small so that communication starts early.
FIRST_BUCKET_BYTES = 1024**2
BUCKET_BYTES = 25 * 1024**2
LANES = 2  # the torch backend's: a main lane and the fast lane


def allreduce_phases(network: Network, ranks: int, nbytes: float, costs: Optional[BackendCosts],
                     kind: str = "all-reduce") -> List[Phase]:
    """One all-reduce of ``nbytes``: the backend's CPU per operation, its fixed wait, its bytes.

    With ``costs`` (a calibration's, measured on 2 ranks) the fixed wait is the measured one
    (less its CPU) plus the network's latency for each message step beyond a 2-rank ring's
    two; without, the network's ``op_seconds`` plus its latency per step. The CPU per byte
    scales with the bytes each rank sends (one tensor's worth on 2 ranks).

    >>> costs = BackendCosts(op_seconds=3e-4, cpu_per_op=1e-4, cpu_per_byte=1e-9)
    >>> [(type(p).__name__, p.name) for p in allreduce_phases(Network(1e8, latency=1e-5), 4, 1000, costs)]
    [('Work', 'launch'), ('Wait', 'latency'), ('Work', 'all-reduce')]
    """
    steps = network.steps(ranks)
    volume = network.volume(nbytes, ranks)
    phases: List[Phase] = []
    if costs is None:
        fixed, per_byte = network.op_seconds + steps * network.latency, 0.0
    else:
        if costs.cpu_per_op > 0:
            phases.append(cpu("launch", costs.cpu_per_op, kind))
        fixed = max(0.0, costs.op_seconds - costs.cpu_per_op) + max(0, steps - 2) * network.latency
        per_byte = costs.cpu_per_byte
    if fixed > 0:
        phases.append(Wait("latency", fixed, kind))
    demand = {LINK: network.transfer_seconds(volume), CORE: per_byte * volume}
    phases.append(Work(kind, 1.0, demand, kind))
    return phases


class GlooLanes:
    """The torch backend's lanes: a thread each, operations in order, the link shared."""

    def __init__(self, sim: Simulation, network: Network, ranks: int, calibration: Optional[Calibration],
                 lanes: int = LANES) -> None:
        self.network = network
        self.ranks = ranks
        self.costs = calibration.backend("gloo") if calibration is not None else None
        self.calibration = calibration
        self.threads = [Thread(sim, f"lane{lane}") for lane in range(lanes)]
        self.operations = 0

    def launch(self, lane: int, nbytes: int, done: Callable[[float], None], copy_back_bytes: int = 0) -> None:
        """All-reduce ``nbytes`` on ``lane``; then copy ``copy_back_bytes`` out (fused pieces)."""
        self.operations += 1
        phases = allreduce_phases(self.network, self.ranks, nbytes, self.costs, f"lane{lane}")
        if copy_back_bytes and self.calibration is not None:
            phases.append(cpu("copy back", self.calibration.memcpy_seconds(copy_back_bytes), "copy"))
        self.threads[lane].run(phases, done)


@dataclass(frozen=True)
class Bucket:
    """A DDP bucket: its gradients' keys, bytes and the layers they belong to."""

    index: int
    keys: Tuple[int, ...]
    nbytes: int
    layers: Tuple[int, ...]

    @property
    def priority(self) -> int:
        """The earliest parameter's position in forward order (the hook's priority with ``model=``)."""
        return min(self.keys)


def ddp_buckets(profile: Profile) -> List[Bucket]:
    """DDP's buckets in launch order: parameters in reverse order, each bucket closed at its cap.

    >>> from bytescheduler_tools.sim.profile import Layer, Tensor
    >>> layers = tuple(Layer(f"l{i}", 0.0, (Tensor(600_000, 0.0),)) for i in range(3))
    >>> [(b.keys, b.nbytes) for b in ddp_buckets(Profile("three", layers, 0.1, 0.0))]
    [((2, 1), 1200000), ((0,), 600000)]
    """
    groups: List[List[Gradient]] = [[]]
    cap = FIRST_BUCKET_BYTES
    for grad in reversed(gradients(profile)):
        groups[-1].append(grad)
        if sum(g.nbytes for g in groups[-1]) >= cap:
            groups.append([])
            cap = BUCKET_BYTES
    groups = [g for g in groups if g]
    return [Bucket(i, tuple(g.key for g in members), sum(g.nbytes for g in members),
                   tuple(sorted({g.layer for g in members}))) for i, members in enumerate(groups)]


class BucketFiller:
    """Which buckets DDP hands over as gradients become ready: a bucket once it is complete
    and every bucket before it was handed over (DDP launches buckets in order)."""

    def __init__(self, profile: Profile) -> None:
        self.buckets = ddp_buckets(profile)
        self._bucket_of = {key: b.index for b in self.buckets for key in b.keys}
        self._grads = {g.key: g for g in gradients(profile)}
        self.reset()

    def reset(self) -> None:
        self._missing = [len(b.keys) for b in self.buckets]
        self._next = 0

    def ready(self, grad: Gradient) -> List[Bucket]:
        """``grad`` is ready: the buckets handed over now, in order."""
        self._missing[self._bucket_of[grad.key]] -= 1
        handed = []
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            handed.append(self.buckets[self._next])
            self._next += 1
        if self._next == len(self.buckets):
            self.reset()
        return handed

    def members(self, bucket: Bucket) -> List[Gradient]:
        return [self._grads[key] for key in bucket.keys]


class DdpReducer(Communication):
    """DDP's reducer over lane 0 (see the module docstring); ``divide``: a separate division pass
    per bucket on the training thread (a Python comm hook's, e.g. DDP's own path of the hook)."""

    def __init__(self, lanes: GlooLanes, profile: Profile, calibration: Optional[Calibration],
                 divide: bool = False) -> None:
        self.lanes = lanes
        self.filler = BucketFiller(profile)
        self.calibration = calibration
        self.divide = divide
        self.total_bytes = profile.gradient_bytes

    def _copy(self, nbytes: float) -> float:
        return self.calibration.memcpy_seconds(nbytes) if self.calibration is not None else 0.0

    def _hook(self, grad: Gradient) -> float:
        """DDP's hook: the reducer's own work and the copy into the bucket (dividing as it copies)."""
        return (self.lanes.costs.hook_cpu if self.lanes.costs else 0.0) + self._copy(grad.nbytes)

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        hook = self._hook(grad)
        for bucket in self.filler.ready(grad):
            if self.divide:
                hook += self._copy(bucket.nbytes)
            members = self.filler.members(bucket)
            self.lanes.launch(0, bucket.nbytes, lambda t, members=members: self.training.communicated(members, t))
        return hook

    def finish_cpu(self) -> float:
        return self._copy(self.total_bytes)  # the buckets back into the gradients

    @property
    def operations(self) -> int:
        return self.lanes.operations


class ScheduledHook(DdpReducer):
    """DDP + the scheduled hook: DDP's buckets, divided in the hook, through the real policy."""

    def __init__(self, lanes: GlooLanes, profile: Profile, calibration: Optional[Calibration],
                 config: SchedulerConfig, sim: Simulation) -> None:
        super().__init__(lanes, profile, calibration, divide=True)
        costs = lanes.costs
        self.driver = PolicyDriver(sim, config, LANES, self._launch, self._done,
                                   cpu_per_op=costs.ours_cpu_per_op if costs else 0.0,
                                   cpu_per_fused_byte=self._copy(1.0))

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        hook = self._hook(grad)
        for bucket in self.filler.ready(grad):
            hook += self._copy(bucket.nbytes)
            self.driver.submit(self.filler.members(bucket), bucket.index, bucket.nbytes, bucket.priority)
            if bucket.index == len(self.filler.buckets) - 1:
                self.driver.end_burst()  # the hook's last bucket: backward is over
        return hook

    def _launch(self, op: Operation, finished: Callable[[float], None]) -> None:
        self.lanes.launch(op.lane, op.nbytes, finished, op.nbytes if len(op.pieces) > 1 else 0)

    def _done(self, payloads: List[List[Gradient]], now: float) -> None:
        self.training.communicated([g for members in payloads for g in members], now)

    @property
    def operations(self) -> int:
        return self.driver.operations


class ScheduledAllReduce(ScheduledCommunication):
    """ScheduledOptimizer over torch.distributed: every gradient through the real policy."""

    def __init__(self, lanes: GlooLanes, calibration: Optional[Calibration], config: SchedulerConfig,
                 sim: Simulation) -> None:
        self.lanes = lanes
        self.calibration = calibration
        costs = lanes.costs
        self.driver = PolicyDriver(sim, config, LANES, self._launch, self._done,
                                   cpu_per_op=costs.ours_cpu_per_op if costs else 0.0,
                                   cpu_per_fused_byte=self._copy(1.0))

    def _copy(self, nbytes: float) -> float:
        return self.calibration.memcpy_seconds(nbytes) if self.calibration is not None else 0.0

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        self.driver.submit(grad, grad.key, grad.nbytes, grad.key)
        ours = self.lanes.costs.ours_hook_cpu if self.lanes.costs else 0.0
        return ours + self._copy(grad.nbytes)  # our hook, and its division by the world size

    def _launch(self, op: Operation, finished: Callable[[float], None]) -> None:
        self.lanes.launch(op.lane, op.nbytes, finished, op.nbytes if len(op.pieces) > 1 else 0)
