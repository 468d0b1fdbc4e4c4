"""Shared resources as fluids: a rank's CPU core(s) and links, divided max-min fair among activities.

An :class:`Activity` is work that progresses at a rate: a layer's forward on the training
thread (CPU-seconds), an all-reduce's transfer (which needs the link and, per byte, the
CPU), an update on the updater thread. Each unit of its work needs ``demand[resource]`` of
each resource it uses. Whenever activities start or end, :meth:`Fluid.allocate` divides
every resource max-min fair among its users, as the kernel divides a core among runnable
threads (CFS) and TCP a link among connections: each user gets an equal share, except that
one limited elsewhere (by another resource, or by being one thread on one core) takes only
what it can use and leaves the rest to the others.

>>> fluid = Fluid({"core": 1.0, "link": 1.0})
>>> compute = fluid.start(Activity("forward", 1.0, {"core": 1.0}), now=0.0)
>>> send = fluid.start(Activity("all-reduce", 1.0, {"link": 1.0, "core": 0.2}), now=0.0)
>>> fluid.allocate(); round(send.rate, 3), round(compute.rate, 3)  # the send uses 20% of the core
(1.0, 0.8)
>>> [(a.name, milestone) for a, milestone in fluid.advance(fluid.next_time())], fluid.now
([('all-reduce', None)], 1.0)

A shadow competes for its share of a resource but is never slowed by it (the same thread
on another machine, where that machine's server runs):

>>> fluid = Fluid({"core": 1.0, "core@1": 1.0})
>>> training = fluid.start(Activity("backward", 1.0, {"core": 1.0}, shadow={"core@1": 1.0}), now=0.0)
>>> server = fluid.start(Activity("server 1", 1.0, {"core@1": 1.0}), now=0.0)
>>> fluid.allocate(); training.rate, server.rate
(1.0, 0.5)
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

# Work left below this counts as done (float rounding of rates and times).
_EPSILON = 1e-12
# Rounds of the allocation: each divides every resource given the others' limits.
_ROUNDS = 4
CORE = "core"  # the CPU resource: one thread uses at most one core of it


def is_core(resource: str) -> bool:
    """A CPU resource (``core``, the simulated rank's; ``core@<machine>``, another machine's)."""
    return resource == CORE or resource.startswith(CORE + "@")


class Activity:
    """Work in progress: ``work`` units, each needing ``demand[resource]`` of each resource.

    ``milestones``: progress levels (units done) at which ``on_milestone(level_index)`` runs,
    ascending; ``on_done`` runs at the end. ``rate`` (units per second) is set by
    :meth:`Fluid.allocate`.
    """

    __slots__ = ("name", "work", "done", "demand", "shadow", "rate", "milestones", "next_milestone", "on_milestone",
                 "on_done", "started", "tag")

    def __init__(self, name: str, work: float, demand: Dict[str, float],
                 on_done: Optional[Callable[[float], None]] = None, milestones: Tuple[float, ...] = (),
                 on_milestone: Optional[Callable[[int, float], None]] = None, tag: object = None,
                 shadow: Optional[Dict[str, float]] = None) -> None:
        self.name = name
        self.work = max(0.0, work)
        self.done = 0.0
        self.demand = {resource: amount for resource, amount in demand.items() if amount > 0}
        # Resources it takes the same share of, without being held back by them: the other
        # machines' cores, where the same thread of every rank runs alike (see ps.py).
        self.shadow = {resource: amount for resource, amount in (shadow or {}).items() if amount > 0}
        self.rate = 0.0
        self.milestones = list(milestones)
        self.next_milestone = 0
        self.on_milestone = on_milestone
        self.on_done = on_done
        self.started = 0.0
        self.tag = tag  # what the owner wants back (e.g. the layer, for a Gantt chart)

    @property
    def left(self) -> float:
        return self.work - self.done

    def add_work(self, extra: float) -> None:
        """Insert ``extra`` units of work at the current progress: later milestones move by it."""
        if extra <= 0:
            return
        self.work += extra
        for index in range(self.next_milestone, len(self.milestones)):
            self.milestones[index] += extra

    def _next_level(self) -> float:
        if self.next_milestone < len(self.milestones):
            return min(self.milestones[self.next_milestone], self.work)
        return self.work


def waterfill(capacity: float, ceilings: List[float]) -> List[float]:
    """Divide ``capacity`` equally among users, none above its ceiling (max-min fairness).

    >>> waterfill(1.0, [0.1, 5.0, 5.0])
    [0.1, 0.45, 0.45]
    """
    shares = [0.0] * len(ceilings)
    left = capacity
    order = sorted(range(len(ceilings)), key=lambda i: ceilings[i])
    for position, index in enumerate(order):
        fair = left / (len(order) - position)
        shares[index] = min(ceilings[index], fair)
        left -= shares[index]
    return shares


class Fluid:
    """Resources with capacities (units per second) and the activities that share them.

    A resource missing from ``capacities`` is unlimited. CPU resources (:func:`is_core`) are
    special: one activity (one thread) uses at most one unit of each, however many cores.
    """

    def __init__(self, capacities: Dict[str, float]) -> None:
        self.capacities = dict(capacities)
        self.active: List[Activity] = []
        self.now = 0.0
        self.used: Dict[str, float] = {}  # resource -> units used so far (busy time)
        self._stale = True

    def start(self, activity: Activity, now: float) -> Activity:
        """Add ``activity`` (call :meth:`advance` up to ``now`` first)."""
        activity.started = now
        self.active.append(activity)
        self._stale = True
        return activity

    def stop(self, activity: Activity) -> None:
        """Remove ``activity`` before it is done."""
        self.active.remove(activity)
        self._stale = True

    def allocate(self) -> None:
        """Set every active activity's rate: each resource divided max-min fair among its users."""
        self._stale = False
        active = self.active
        limits = [dict.fromkeys(a.demand, math.inf) for a in active]  # rate each resource allows
        users: Dict[str, List[int]] = {}
        shadows: Dict[str, List[int]] = {}
        for index, activity in enumerate(active):
            for resource in activity.demand:
                users.setdefault(resource, []).append(index)
            for resource in activity.shadow:
                shadows.setdefault(resource, []).append(index)
        for _ in range(_ROUNDS):
            changed = False
            for resource, members in users.items():
                capacity = self.capacities.get(resource, math.inf)
                ceilings = []
                for index in members:
                    activity = active[index]
                    others = min((rate for other, rate in limits[index].items() if other != resource), default=math.inf)
                    ceiling = activity.demand[resource] * others
                    if is_core(resource):
                        ceiling = min(ceiling, 1.0)  # one thread, one core
                    ceilings.append(ceiling)
                # A shadow competes for its share like any user, but keeps its own rate.
                for index in shadows.get(resource, ()):
                    rate = min(limits[index].values(), default=math.inf)
                    ceiling = active[index].shadow[resource] * rate
                    ceilings.append(min(ceiling, 1.0) if is_core(resource) else ceiling)
                if math.isinf(capacity) or sum(ceilings) <= capacity:
                    shares = ceilings  # room for everyone's wish
                else:
                    shares = waterfill(capacity, ceilings)
                for index, share in zip(members, shares):
                    rate = share / active[index].demand[resource]
                    if rate != limits[index][resource]:
                        limits[index][resource] = rate
                        changed = True
            if not changed:
                break
        for activity, limit in zip(active, limits):
            activity.rate = min(limit.values(), default=math.inf)

    def _event_time(self, activity: Activity) -> Optional[float]:
        """When ``activity`` reaches its next milestone or its end at its current rate."""
        left = activity._next_level() - activity.done
        if activity.rate == math.inf or left <= _EPSILON:
            return self.now
        if activity.rate <= 0:
            return None
        return self.now + left / activity.rate

    def next_time(self) -> Optional[float]:
        """When the next activity reaches a milestone or its end (None: nothing active)."""
        if self._stale:
            self.allocate()
        times = [t for t in map(self._event_time, self.active) if t is not None]
        return min(times) if times else None

    def advance(self, until: float) -> List[Tuple[Activity, Optional[int]]]:
        """Progress every activity to ``until``; return what happened there, in order: (activity,
        milestone index) for each milestone reached and (activity, None) for each activity that
        ended, which leaves the active set. Running the callbacks is the caller's (see
        :meth:`notify`), so that they see a consistent state."""
        if self._stale:
            self.allocate()
        span = max(0.0, until - self.now)
        # Due at ``until`` up to float rounding of the times (a rate times a tiny span may
        # fall short of the level that was due, and a time plus a tiny step may not move).
        tolerance = _EPSILON * max(1.0, abs(until))
        events: List[Tuple[Activity, Optional[int]]] = []
        ended = []
        for activity in self.active:
            due = self._event_time(activity)
            before = activity.done
            if due is not None and due <= until + tolerance:
                activity.done = max(activity.done, activity._next_level())
            elif span > 0 and activity.rate > 0:
                activity.done = min(activity.work, activity.done + activity.rate * span)
            step = activity.done - before
            if step > 0:
                for resource, amount in activity.demand.items():
                    self.used[resource] = self.used.get(resource, 0.0) + amount * step
            while (activity.next_milestone < len(activity.milestones)
                   and activity.milestones[activity.next_milestone] - activity.done <= _EPSILON):
                events.append((activity, activity.next_milestone))
                activity.next_milestone += 1
            if activity.left <= _EPSILON:
                ended.append(activity)
                events.append((activity, None))
        if ended:
            for activity in ended:
                self.active.remove(activity)
            self._stale = True
        self.now = until
        return events

    def notify(self, events: List[Tuple[Activity, Optional[int]]], now: float) -> None:
        """Run the callbacks of what :meth:`advance` returned. An activity that a milestone's
        callback gave more work just as it was ending goes on instead."""
        for activity, milestone in events:
            if milestone is not None:
                if activity.on_milestone is not None:
                    activity.on_milestone(milestone, now)
            elif activity.left > _EPSILON:
                self.active.append(activity)
                self._stale = True
            elif activity.on_done is not None:
                activity.on_done(now)

    def changed(self) -> None:
        """An activity's demand or work changed: allocate again before the next step."""
        self._stale = True

