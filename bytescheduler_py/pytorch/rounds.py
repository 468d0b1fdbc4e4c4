"""The rounds of an :class:`~bytescheduler.pytorch.overlap.OverlapEngine`: one per step's backward.

A round is the gradients one step communicates; every rank counts the same rounds, and
rank 0 launches a round's gradients before any of the next (see core/policy.py). Most of a
round's gradients go during backward, from the gradient hooks; :meth:`Rounds.finish` ends
it once backward is over (``step()``, or the training thread reads a gradient in flight or
calls ``synchronize()`` after backward): the gradients not communicated during backward
(partial accumulation, parameters that kept a gradient but were unused this iteration) go
then, in key order on every rank, and parameters without one contribute zeros
(:mod:`.unused`). A round ends once per step, and again after a ``zero_grad()`` dropped
the step's gradients (:meth:`Rounds.restart`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .params import IDLE, ParamState
from .progress import Progress
from .read_guard import suspended


class Rounds:
    """Counts the rounds and ends each one (see the module docstring).

    ``submit(state)`` sends a parameter's gradient as it is; ``absence`` gives zeros to the
    parameters without one (:class:`~bytescheduler.pytorch.unused.AbsentGradients`, or None
    for a rank alone); ``irregular()`` is told when a backward ran without some parameters
    (the mode switch then does not time the step). ``notice``, when set (the join context's,
    :mod:`.join`), is called at the end of each round of this rank's own.
    """

    def __init__(self, progress: Progress, states: Dict[int, ParamState], submit: Callable[[ParamState], None],
                 irregular: Callable[[], None]) -> None:
        self._progress = progress
        self._states = states
        self._submit = submit
        self._irregular = irregular
        self.absence: Any = None
        self.notice: Optional[Callable[[], None]] = None
        self.count = 0  # rounds ended (the same on every rank)
        self._open = False  # backward submitted something since the last round ended
        self._finished_step = 0  # the step the last round was ended for

    def opened(self) -> None:
        """Backward submitted a gradient of the coming step (lock held)."""
        self._open = True

    def restart(self) -> None:
        """The step's gradients were dropped: its next backward is a round of its own (lock held)."""
        self._finished_step = 0

    def unfinished(self) -> bool:
        """A backward of the coming step communicated something and its round was not ended."""
        return (self._open and self._finished_step != self._progress.steps_called + 1
                and torch._C._current_graph_task_id() == -1)  # not from a hook inside backward

    def finish(self, shadow: bool = False) -> None:
        """End the coming step's round (once; see the module docstring).

        ``shadow``: a rank out of data (:mod:`.join`) takes part in the others' round with
        zeros for every parameter, whose averages it then drops (it updates nothing)."""
        progress = self._progress
        step = progress.steps_called + 1
        if self._finished_step == step and not shadow:
            return
        if not shadow and self.notice is not None:
            self.notice()
        self._finished_step = step
        self._open = False
        states = self._states.values()
        late = [s for s in states if not s.sparse and not (s.stage != IDLE and s.step_number == step)]
        if 0 < len(late) < sum(1 for s in states if not s.sparse):
            self._irregular()  # a backward ran, without some parameters
        absent: List[ParamState] = []
        for state in late:
            if state.stage != IDLE:
                progress.wait_readable(state)  # unused since its last step's update, still pending
            with suspended():
                kept = state.param.grad is not None and not shadow
            if kept:
                self._submit(state)
            elif self.absence is not None:
                absent.append(state)
        with progress.cond:
            round_ = self.count + 1
            if self.absence is not None:
                self.absence.begin(round_, step, absent, shadow)
            if shadow:
                for state in absent:
                    state.discard = True
            self.count = round_
        if self.absence is not None:
            self.absence.send(round_, absent)

    def end_plain(self) -> None:
        """A round on the plain path (its ``step()``): counted, and noticed."""
        if self.notice is not None:
            self.notice()
        self.count += 1
