"""The plain path of a ScheduledKVStore: MXNet's own calls, for when scheduling does not pay.

With ``adaptive`` (the default) rank 0 times training steps through the scheduler against
steps whose calls go straight to the inner store, as an unwrapped ``dist_sync`` store would
make them, and runs the faster (:class:`~bytescheduler.core.modes.ModeDriver`). On the plain
path a ``push``, ``pull`` or ``pushpull`` is one call of the inner store from the caller's
thread, over the same server keys (a partitioned key's sub-keys in one list call), so the
servers do the same arithmetic either way. Only one path runs at a time: the store drains
the scheduled path (or waits for the plain path's arrays) before it switches, so no two
threads ever call the inner store at once.

:class:`StoreModes` runs the switch: :class:`PlainCalls` makes the calls,
:class:`StepClock` tells where a training step begins, :class:`StoreAgreement` carries rank
0's decision to every worker through the store itself.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import mxnet as mx
import numpy as np

from ..core.config import SchedulerConfig
from ..core.modes import PLAIN, STOP, ModeDriver, new_chooser
from ..core.scheduler import Scheduler
from .backend import wait_to_write
from .keys import DECISION_KEYS, KeyInfo, KeyLayout, mx_args, rank0_words


class PlainCalls:
    """The inner store's own calls over the keys' sub-keys, remembering what to wait for."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        # Arrays pushed (read) and pulled into (written) since the last drain, by id: gluon
        # passes the same arrays every step, so these stay as large as the model.
        self._read: Dict[int, Any] = {}
        self._written: Dict[int, Any] = {}
        self._step: Dict[int, Any] = {}  # the arrays pulled into in the current step
        self._marks: Deque[List[Any]] = deque()  # per step, oldest first: see new_step
        self._firsts: Dict[int, Tuple[Any, Any]] = {}  # id -> (array, a view of its first element)

    def push(self, infos: Sequence[KeyInfo], values: Sequence[List[Any]], priority: int) -> None:
        keys, arrays = _split(infos, values)
        self._inner.push(*mx_args(keys, arrays), priority=priority)
        self._note(self._read, values)

    def pull(self, infos: Sequence[KeyInfo], outs: Sequence[List[Any]], priority: int, ignore_sparse: bool) -> None:
        keys, arrays = _split(infos, outs)
        out_key, out = mx_args(keys, arrays)
        self._inner.pull(out_key, out=out, priority=priority, ignore_sparse=ignore_sparse)
        self._note(self._written, outs)
        self._note(self._step, outs)

    def pushpull(self, infos: Sequence[KeyInfo], values: Sequence[List[Any]], outs: Sequence[List[Any]],
                 priority: int) -> None:
        keys, pushed = _split(infos, values)
        _, pulled = _split(infos, outs)
        self._inner.pushpull(*mx_args(keys, pushed), out=mx_args(keys, pulled)[1], priority=priority)
        self._note(self._read, values)
        self._note(self._written, outs)
        self._note(self._step, outs)

    @staticmethod
    def _note(seen: Dict[int, Any], groups: Sequence[List[Any]]) -> None:
        for group in groups:
            for arr in group:
                seen[id(arr)] = arr

    def new_step(self) -> None:
        """A training step begins: wait until the pulls of the step before the last completed
        (see ``StoreModes._pace``).

        The arrays are the same every step, and MXNet's ``wait_to_read`` waits for every write
        queued so far, the last step's pulls included. So each step's pulls get a mark: a
        copy of each array's first element, queued behind that step's pulls and ahead of the
        next step's, which completes when that step's pulls did.
        """
        if self._step:
            self._marks.append(self._mark(list(self._step.values())))
            self._step = {}
        while len(self._marks) > 1:
            for mark in self._marks.popleft():
                mark.wait_to_read()

    def _mark(self, arrays: List[Any]) -> List[Any]:
        views: Dict[Any, List[Any]] = {}
        if len(self._firsts) > 4 * len(self._written) + 64:
            self._firsts.clear()  # arrays made afresh each step: let go of them
        for arr in arrays:
            entry = self._firsts.get(id(arr))
            if entry is None or entry[0] is not arr:
                if arr.size == 0:
                    continue
                entry = self._firsts[id(arr)] = (arr, arr.reshape(-1)[0:1])
            views.setdefault(np.dtype(arr.dtype), []).append(entry[1])
        return [group[0].copy() if len(group) == 1 else mx.nd.concat(*group, dim=0) for group in views.values()]

    def drain(self) -> None:
        """Wait until every call made so far has finished (before the scheduled path takes over)."""
        written, read = list(self._written.values()), list(self._read.values())
        self._written, self._read, self._step = {}, {}, {}
        self._marks.clear()
        for arr in written:
            arr.wait_to_read()
        for arr in read:
            wait_to_write(arr)


def _split(infos: Sequence[KeyInfo], arrays: Sequence[List[Any]]) -> Tuple[List[Any], List[List[Any]]]:
    """Server keys and their arrays: a key's own arrays, or views of them per sub-key."""
    if len(infos) == 1 and not infos[0].partitioned:  # gluon's call: one whole key
        return [infos[0].subkeys[0]], [arrays[0]]
    keys: List[Any] = []
    groups: List[List[Any]] = []
    for info, group in zip(infos, arrays):
        if not info.partitioned:
            keys.append(info.subkeys[0])
            groups.append(list(group))
            continue
        keys.extend(info.subkeys)
        groups.extend(info.groups(group))
    return keys, groups


class StepClock:
    """Where a training step begins: at the push of a key already pushed since the last start.

    gluon's Trainer pushes every key once per step, so the second push of any key (the first
    key of the next step) begins a step; a key pushed over and over (a bandwidth probe) makes
    each of its pushes a step.
    """

    def __init__(self) -> None:
        self._pushed: Set[int] = set()
        self.steps = 0  # steps begun

    def begins(self, infos: Sequence[KeyInfo]) -> bool:
        """Record pushes of ``infos``; True when they begin a step (the first step included)."""
        indices = [info.index for info in infos]
        begins = not self.steps or any(index in self._pushed for index in indices)
        if begins:
            self._pushed = set()
            self.steps += 1
        self._pushed.update(indices)
        return begins


class StoreAgreement:
    """``agree(proposal, veto)`` over the store: rank 0 initialises a fresh reserved key with
    its proposal (``init`` is collective on a dist store: it waits for every worker) and
    every worker pulls it. The plain path is MXNet's own, valid whatever each worker does,
    so workers have nothing to veto; ``veto`` is ignored. Called from the training thread
    while neither path has calls in flight. After :data:`~bytescheduler.mxnet.keys.DECISION_KEYS`
    decisions of int keys (millions of steps) the switch stops on the scheduled path."""

    def __init__(self, inner: Any, rank: int, layout: KeyLayout) -> None:
        self._inner = inner
        self._rank = rank
        self._layout = layout
        self.decisions = 0

    def __call__(self, proposal: int, veto: bool) -> int:
        if self.decisions >= DECISION_KEYS and not self._layout.str_keys:
            return STOP
        key = self._layout.decision_key(self.decisions)
        self.decisions += 1
        value = rank0_words(self._inner, key, [proposal if self._rank == 0 else 0])[0]
        decided = int(value)
        if decided != value or decided < 0:
            raise ValueError(f"rank {self._rank}: the mode switch read decision {decided} from the store")
        return decided


# Steps left untimed after each switch of paths (and after a decision point reached on the
# scheduled path, which drains it too: ModeChooser's settle). The switch drains the path it leaves, and
# the pacing (StoreModes._pace) then lets the training thread run a step ahead of MXNet's
# engine again, so the second step after a switch is also off (a scheduled trial's much
# shorter than its others, a plain trial's much longer). The third step is steady.
SETTLE_STEPS = 2

# On a hold of the plain path the pacing stops until this many steps before the first one
# whose time the switch reads (ModeChooser.unread_steps): the first paced step waits for the
# engine to catch up with every step queued meanwhile, the second is the settle's, then the
# steps are timed as in a trial.
PACE_AHEAD = SETTLE_STEPS + 2


class StoreModes:
    """A ScheduledKVStore's mode switch: which path this step's calls take.

    ``configure(settings)`` turns it on with ``adaptive`` (off with ``auto_tune``, which tunes
    the schedule, and with one worker); the store calls it again with rank 0's settings once
    the first ``init`` connected the workers. ``drain()`` waits for the scheduled path.
    """

    def __init__(self, inner: Any, rank: int, num_workers: int, layout: KeyLayout, scheduler: Scheduler,
                 drain: Callable[[], None], wait_done: Callable[[Any], None]) -> None:
        self.calls = PlainCalls(inner)
        self.plain = False  # this step's calls go straight to the inner store
        self.driver: Optional[ModeDriver] = None
        self._inner, self._rank, self._num_workers, self._layout = inner, rank, num_workers, layout
        self._scheduler = scheduler
        self._drain = drain
        self._wait_done = wait_done  # wait until a scheduled operation (a backend Job) completed
        self._scheduled: Deque[List[Any]] = deque()  # rank 0: each step's last scheduled operations
        self._steps = StepClock()

    def configure(self, settings: SchedulerConfig) -> None:
        if settings.adaptive and not settings.auto_tune and self._num_workers > 1:
            chooser = new_chooser(settings.mode_switch, settings.start_plain, settle=SETTLE_STEPS)
            self.driver = ModeDriver(chooser, self._rank == 0,
                                     StoreAgreement(self._inner, self._rank, self._layout), rank=self._rank)
        else:
            self.driver = None
        self.plain = self.driver is not None and self.driver.mode == PLAIN  # a plan may start plain

    def begin_step(self, pushed: Sequence[KeyInfo]) -> bool:
        """At a push of ``pushed``: when it begins a training step, let the switch see the last
        one end. True when this call takes the plain path."""
        if self._steps.begins(pushed):
            if self.driver is not None and self._steps.steps > 1:
                if self.paced():
                    self._pace()
                old = self.driver.mode
                new = self.driver.end_step(drain=self._drain)
                if new != old and old == PLAIN:
                    self.calls.drain()  # the scheduled path waits for nothing of ours
                self.plain = new == PLAIN
            if not self.plain:
                self._scheduler.step_boundary()
        return self.plain

    def paced(self) -> bool:
        """Whether the step now beginning waits for the step before the last (:meth:`_pace`).

        Only where the switch reads step times: on a long hold of the plain path no step is
        timed but its last few (the re-trial's reference), and there the wait only held the
        training thread back where an unwrapped store lets it run ahead of MXNet's engine (it
        made the store slower than ``dist_sync``). The scheduled path is paced on every step.
        """
        return not self.plain or self.driver.chooser.unread_steps <= PACE_AHEAD

    def _pace(self) -> None:
        """A step begins: wait until the step before the last one completed its communication.

        The switch times a step from one step's first push to the next one's. MXNet's calls
        return before they run and gluon's Trainer never waits, so without this wait the
        plain path's step times would be how long queueing their calls took (a small part of
        the step), and the switch would choose MXNet's own calls every time.
        Waiting for the step before the last (not the last) leaves this thread a step ahead
        of the engine, so it queues a step's calls while the engine still runs the step
        before, not between that step's pulls and the next forward. The plain path's pulls
        are waited for on every worker, through a mark per step (:meth:`PlainCalls.new_step`);
        the schedule's operations, which its credit already holds back, on rank 0 only, the
        one that times.
        """
        self.calls.new_step()
        if self._rank != 0:
            return
        self._scheduled.append([info.last for info in self._layout.infos() if info.last is not None])
        while len(self._scheduled) > 1:  # each step's list: the operations of the steps before it
            for job in self._scheduled.popleft():
                self._wait_done(job)
