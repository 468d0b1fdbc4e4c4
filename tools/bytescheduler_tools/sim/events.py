"""The discrete-event core: a clock with timers, the fluid of shared resources, and threads.

A :class:`Simulation` advances time to whichever comes first, the next timer or the next
moment an activity of its :class:`~bytescheduler_tools.sim.fluid.Fluid` reaches a milestone or
ends, and runs what happens then. A :class:`Thread` is one thread of a rank (the training
thread, gloo's thread of a lane, Horovod's background thread, our dispatcher, the updater):
it runs its jobs one after another, each a list of phases, either work on the fluid (CPU,
link) or a plain wait. With ``record`` the simulation keeps every phase as a span, for a
Gantt chart.

>>> sim = Simulation({"core": 1.0})
>>> updater, trainer = Thread(sim, "updater"), Thread(sim, "training")
>>> ends = []
>>> trainer.run([Work("forward", 1.0, {"core": 1.0})], lambda now: ends.append(("forward", now)))
>>> updater.run([Work("update", 0.5, {"core": 1.0})], lambda now: ends.append(("update", now)))
>>> sim.run_until(lambda: len(ends) == 2); [(name, round(t, 3)) for name, t in ends]
[('update', 1.0), ('forward', 1.5)]
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union
from collections import deque

from .fluid import CORE, Activity, Fluid

Callback = Callable[[float], None]


class Stalled(RuntimeError):
    """Nothing is running and nothing is due: the simulated system waits for itself."""


@dataclass
class Span:
    """One phase of a thread, for a Gantt chart: row (thread), name, kind, start and end."""

    row: str
    name: str
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class Work:
    """A phase that needs resources: ``amount`` units, each needing ``demand`` of each resource.

    CPU work is ``Work(name, cpu_seconds, {"core": 1.0})``."""

    name: str
    amount: float
    demand: Dict[str, float]
    kind: str = ""  # the Gantt chart's colour (default: the name)
    # Progress levels (units done, ascending) at which ``on_milestone(index, now)`` runs; it
    # returns units of work to insert right there (e.g. a gradient hook's CPU), or 0.
    milestones: Tuple[float, ...] = ()
    on_milestone: Optional[Callable[[int, float], float]] = None


@dataclass(frozen=True)
class Wait:
    """A phase that only takes time (a message's latency, a sleep)."""

    name: str
    seconds: float
    kind: str = ""


Phase = Union[Work, Wait]


def cpu(name: str, seconds: float, kind: str = "") -> Work:
    """A phase of ``seconds`` of CPU on one thread."""
    return Work(name, seconds, {CORE: 1.0}, kind)


class Simulation:
    """Simulated time: timers, the fluid of resources, and what was recorded."""

    def __init__(self, capacities: Dict[str, float], record: bool = False) -> None:
        self.fluid = Fluid(capacities)
        self.now = 0.0
        self._timers: List[Tuple[float, int, Callback]] = []
        self._order = itertools.count()
        self.record = record
        self.spans: List[Span] = []
        # Other machines' cores, where the simulated rank's threads stand for their own
        # (shadows: they take the same share there, and the other machine's server the rest;
        # the parameter server's machines, see :mod:`bytescheduler_tools.sim.ps`).
        self.mirror_cores: Tuple[str, ...] = ()

    def at(self, when: float, action: Callback) -> None:
        """Run ``action(now)`` at ``when`` (not before now)."""
        heapq.heappush(self._timers, (max(when, self.now), next(self._order), action))

    def start(self, activity: Activity) -> Activity:
        return self.fluid.start(activity, self.now)

    def run_until(self, done: Callable[[], bool], limit: float = float("inf")) -> None:
        """Run events until ``done()`` is true (checked after each moment) or time passes ``limit``."""
        fluid, timers = self.fluid, self._timers
        while not done():
            fluid_time = fluid.next_time()
            timer_time = timers[0][0] if timers else None
            if fluid_time is None and timer_time is None:
                raise Stalled("the simulation stalled: nothing runs and nothing is due")
            when = fluid_time if timer_time is None else timer_time if fluid_time is None else min(fluid_time, timer_time)
            if when > limit:
                return
            events = fluid.advance(when)
            self.now = when
            fluid.notify(events, when)
            while timers and timers[0][0] <= when:
                _, _, action = heapq.heappop(timers)
                action(when)

    def busy(self, resource: str) -> float:
        """Units of ``resource`` used so far (for a link of capacity 1: seconds busy)."""
        return self.fluid.used.get(resource, 0.0)


@dataclass
class _Job:
    phases: List[Phase]
    done: Optional[Callback]
    tag: object = None


class Thread:
    """One thread of the rank: jobs run one after another, phases in order."""

    def __init__(self, sim: Simulation, name: str, mirrored: bool = True) -> None:
        self.sim = sim
        self.name = name
        self.mirrored = mirrored  # its CPU stands for every rank's (see Simulation.mirror_cores)
        self._jobs: Deque[_Job] = deque()
        self._phase = 0
        self._phase_start = 0.0

    @property
    def idle(self) -> bool:
        return not self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def run(self, phases: List[Phase], done: Optional[Callback] = None, tag: object = None) -> None:
        """Queue a job: ``phases`` in order, then ``done(now)``."""
        self._jobs.append(_Job(list(phases), done, tag))
        if len(self._jobs) == 1:
            self._phase = 0
            self._begin()

    def _begin(self) -> None:
        job = self._jobs[0]
        sim = self.sim
        while self._phase < len(job.phases):
            phase = job.phases[self._phase]
            self._phase_start = sim.now
            if isinstance(phase, Wait):
                if phase.seconds > 0:
                    sim.at(sim.now + phase.seconds, self._phase_ended)
                    return
            elif phase.amount > 0:
                shadow = None
                if self.mirrored and sim.mirror_cores and CORE in phase.demand:
                    shadow = {core: phase.demand[CORE] for core in sim.mirror_cores}
                activity = Activity(phase.name, phase.amount, phase.demand, on_done=self._phase_ended, tag=job.tag,
                                    shadow=shadow,
                                    milestones=tuple(min(level, phase.amount) for level in phase.milestones))
                if phase.on_milestone is not None:
                    activity.on_milestone = self._milestone_handler(activity, phase.on_milestone)
                sim.start(activity)
                return
            self._phase += 1
        self._job_ended(sim.now)

    def _milestone_handler(self, activity: Activity, handler: Callable[[int, float], float]) -> Callable[[int, float], None]:
        def reached(index: int, now: float) -> None:
            extra = handler(index, now)
            if extra > 0:
                activity.add_work(extra)
                self.sim.fluid.changed()
        return reached

    def _phase_ended(self, now: float) -> None:
        job = self._jobs[0]
        phase = job.phases[self._phase]
        if self.sim.record and now > self._phase_start:
            self.sim.spans.append(Span(self.name, phase.name, phase.kind or phase.name, self._phase_start, now))
        self._phase += 1
        self._begin()

    def _job_ended(self, now: float) -> None:
        job = self._jobs.popleft()
        self._phase = 0
        if self._jobs:
            self._begin()
        if job.done is not None:
            job.done(now)
