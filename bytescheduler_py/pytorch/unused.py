"""Parameters without a gradient on some ranks: what DDP and Horovod do, on the schedule.

A branch one rank skips (conditional computation, mixture-of-experts routing) leaves
that rank without a gradient for some parameters while others have one. The
:class:`~bytescheduler.pytorch.overlap.OverlapEngine` hands such a parameter here at
``step()`` (its backward is over) and it contributes zeros, with the framework's rule
for a parameter no rank used:

- ``Absence.DDP`` (ScheduledOptimizer over torch.distributed), as
  ``DistributedDataParallel(find_unused_parameters=True)``: a parameter some rank used
  gets the average with zeros for the others; one that no rank used keeps no gradient
  (the optimizer skips it). Rank 0 orders every communication, so it decides: in a step
  where rank 0 itself lacks some gradients, it all-reduces one small tensor of flags (1:
  this rank had the gradient) and schedules the zeros of those some rank used. Every
  other rank offers its zeros as stand-ins (:meth:`Scheduler.offer
  <bytescheduler.core.scheduler.Scheduler.offer>`): they go when rank 0 schedules them
  and are withdrawn when the flags say no rank used them. A step in which rank 0 had
  every gradient costs nothing here, whatever the others lacked.
- ``Absence.HOROVOD`` (over ``hvd.DistributedOptimizer``), as Horovod's ``synchronize()``:
  every rank all-reduces zeros for each gradient it lacks, so a parameter no rank used
  gets a zero gradient and the optimizer steps it.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core import Task
from .params import ParamState
from .read_guard import suspended

# The flags' key: beyond any parameter's (keys count parameters from 0).
FLAGS_KEY = 1 << 40
# Rounds whose absent parameters a follower remembers for rank 0's flags (rank 0 cannot get
# a round further before it applied them: the next forward waits for those parameters).
_REMEMBERED_ROUNDS = 8


class Absence(enum.Enum):
    """The rule for a parameter no rank produced a gradient for (see the module docstring)."""

    DDP = "ddp"
    HOROVOD = "horovod"


class AbsentGradients:
    """The engine's side of the protocol above, for one :class:`OverlapEngine`.

    When a step's backward is over the engine calls :meth:`begin` (its lock held) with the
    parameters this rank's backward did not produce, then :meth:`send` (lock not held). Each
    moves IDLE -> QUEUED in :meth:`begin` and ends as a communicated zero gradient (the
    engine's usual path from there) or, dropped, back at IDLE with no gradient and no update.
    """

    def __init__(self, engine: Any, rule: Absence) -> None:
        self._engine = engine
        self.rule = rule
        self._leader = engine.scheduler.rank == 0
        # round (see OverlapEngine.finish_backward) -> what this rank lacked, until settled
        self._absent: Dict[int, List[ParamState]] = {}
        self._reported: Dict[int, List[ParamState]] = {}  # round -> what its flags call absent
        self._last_absent: List[ParamState] = []  # of the last round of this rank's own
        if rule is Absence.DDP:
            engine.scheduler.provide(FLAGS_KEY, self._follower_flags)

    # ------------------------------------------------------------------ at step()

    def begin(self, round_: int, step: int, states: Sequence[ParamState], shadow: bool = False) -> None:
        """Give each of ``states`` a zero gradient and make it QUEUED for ``step``, in the
        engine's ``round_`` (lock held). ``shadow``: a rank out of data (:mod:`.join`) takes
        part in the others' round; its flags then say what it had in its last round of its
        own, as DDP's joined rank all-reduces the map of parameters it last used."""
        engine = self._engine
        with suspended():
            for state in states:
                param = state.param
                zeros = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                param.grad = zeros
                engine.transfers.queue(state, zeros, step, round_)
        if self.rule is not Absence.DDP:
            return
        if not shadow:
            self._last_absent = list(states)
        if states:
            self._absent[round_] = list(states)
            self._reported[round_] = self._last_absent if shadow else self._absent[round_]
            if not self._leader:  # settled by rank 0's flags, if it sends any: remember a few
                for old in [r for r in self._absent if r <= round_ - _REMEMBERED_ROUNDS]:
                    del self._absent[old]
                    self._reported.pop(old, None)

    def send(self, round_: int, states: Sequence[ParamState]) -> None:
        """Hand the zeros of :meth:`begin` on (lock not held)."""
        engine = self._engine
        scheduler = engine.scheduler
        if self.rule is Absence.HOROVOD:
            for state in states:
                engine.transfers.schedule(state)
        elif not self._leader:
            engine.transfers.offer(states)
            scheduler.poke()  # rank 0's flags for this round may be waiting for it
        elif states:
            flags = self._flags(round_, self._reported.pop(round_))
            payload = flags.payload
            # The zeros the flags call for belong to this round: nothing of the next may go
            # before them (another rank's next forward may wait for them).
            scheduler.hold(round_)
            scheduler.submit(flags).add_done_callback(lambda done: self._leader_outcome(round_, payload, done))

    # ------------------------------------------------------------------ the flags

    def _flags(self, round_: int, absent: Sequence[ParamState]) -> Task:
        """This rank's flags for ``round_``: 1 for each parameter it had a gradient for."""
        states = self._engine.states.values()
        device = next((s.param.device for s in states if not s.sparse), torch.device("cpu"))
        flags = torch.ones(1 + max(s.key for s in states), dtype=torch.float32, device=device)
        if absent:
            flags[torch.tensor([s.key for s in absent], dtype=torch.long, device=device)] = 0
        task = Task(key=FLAGS_KEY, numel=flags.numel(), itemsize=4, priority=-1, payload=flags,
                    fuse_key=None, name="unused-parameter flags")  # alone: see the fence
        task.generation = task.iteration = round_
        return task

    def _follower_flags(self, round_: int) -> Optional[Task]:
        """Rank 0 scheduled the flags of ``round_`` (called under the scheduler's lock): this
        rank's, once its own round is over; None until then."""
        if self._engine.rounds < round_:
            return None
        task = self._flags(round_, self._reported.pop(round_, ()))
        payload = task.payload
        task.future.add_done_callback(lambda done: self._follower_outcome(round_, payload, done))
        return task

    @staticmethod
    def _unused(flags: torch.Tensor, states: Sequence[ParamState]) -> List[ParamState]:
        """Those of ``states`` no rank had a gradient for (their flags summed to zero)."""
        with suspended():
            counts = flags.tolist()
        return [s for s in states if counts[s.key] <= 0]

    def _leader_outcome(self, round_: int, flags: torch.Tensor, done: Any) -> None:
        """Rank 0: schedule the zeros of the parameters some rank used; drop the others."""
        states = self._absent.pop(round_)
        try:
            if done.exception() is not None:
                return  # the engine learns the scheduler's error from the scheduler
            unused = self._unused(flags, states)
            self._drop(unused)
            for state in states:
                if state not in unused:
                    self._engine.transfers.schedule(state)
        finally:
            self._engine.scheduler.release(round_)

    def _follower_outcome(self, round_: int, flags: torch.Tensor, done: Any) -> None:
        """Another rank: withdraw the stand-ins no rank used (those rank 0 will not schedule)."""
        states = self._absent.pop(round_, [])
        if done.exception() is not None:
            return
        unused = self._unused(flags, states)
        self._engine.scheduler.withdraw([s.task for s in unused], fence=True)
        self._drop(unused)

    def _drop(self, states: List[ParamState]) -> None:
        """No rank used ``states``: no gradient and no update, as DDP leaves them."""
        if states:
            self._engine.transfers.drop(states)
