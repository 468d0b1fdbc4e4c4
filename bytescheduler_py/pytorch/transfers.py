"""A parameter's gradient on its way: queued as a task, communicated, handed to the updater.

:class:`Transfers` moves a parameter QUEUED (its gradient the payload of a
:class:`~bytescheduler.core.task.Task`) -> submitted to the scheduler -> COMMUNICATED and
waiting in the :class:`~bytescheduler.pytorch.updates.Updater` for its step; or back to
IDLE where the average is not needed (a discarded step, zeros no rank needs). A gradient
changed in place while it is communicated fails the engine with a
:class:`~bytescheduler.pytorch.errors.GradientError` naming the parameter.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ..core import Scheduler, Task
from .errors import GradientError
from .params import COMMUNICATED, IDLE, QUEUED, ParamState, dense_gradient
from .progress import Progress
from .read_guard import suspended
from .updates import Updater


class Transfers:
    """The engine's gradients between backward and the updater (see the module docstring).

    ``prescale``: divide each gradient by ``world_size`` before it is communicated (the
    backend sums); False when the backend averages itself.
    """

    def __init__(self, progress: Progress, scheduler: Scheduler, updater: Updater, world_size: int,
                 prescale: bool) -> None:
        self._progress = progress
        self._scheduler = scheduler
        self._updater = updater
        self._world_size = world_size
        self._prescale = prescale

    def prepared(self, state: ParamState) -> Optional[torch.Tensor]:
        """The parameter's gradient, checked, contiguous and (``prescale``) divided by the
        world size; None without one. Its accumulated passes start again from 0."""
        with self._progress.cond:
            state.passes = 0
        with suspended():
            grad = dense_gradient(state)
            if grad is not None and self._prescale:
                grad.div_(self._world_size)
        return grad

    def queue(self, state: ParamState, grad: torch.Tensor, step: int, round_: int) -> None:
        """Make ``state`` QUEUED for ``step`` with ``grad`` as its task's payload (lock held).

        ``round_`` is the round the gradient belongs to (the same count on every rank):
        rank 0 launches a round's gradients before any of the next (see core/policy.py)."""
        ready = None
        if grad.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(grad.device))
        state.task = Task(
            key=state.key, numel=grad.numel(), itemsize=grad.element_size(), priority=state.priority,
            payload=grad.view(-1), fuse_key=(grad.dtype, grad.device), name=state.name, context=ready,
        )
        state.task.iteration = round_
        state.grad = grad
        state.version = grad._version
        state.discard = False
        state.step_number = step
        self._progress.set_stage(state, QUEUED)

    def schedule(self, state: ParamState) -> None:
        """Submit ``state``'s queued task; its update follows once it is communicated."""
        self._scheduler.submit(state.task).add_done_callback(lambda done, state=state: self.communicated(state, done))

    def offer(self, states: Sequence[ParamState]) -> None:
        """Offer ``states``' queued tasks, which go only if rank 0's order calls for them
        (:meth:`~bytescheduler.core.scheduler.Scheduler.offer`)."""
        for state in states:
            future = self._scheduler.offer(state.task)
            future.add_done_callback(lambda done, state=state: self.communicated(state, done))

    def drop(self, states: List[ParamState]) -> None:
        """``states`` were queued with zeros that no rank needs (:mod:`.unused`): back to IDLE
        with no gradient and no update."""
        progress = self._progress
        with progress.cond:
            with suspended():
                for state in states:
                    if state.param.grad is state.grad:
                        state.param.grad = None
            for state in states:
                state.grad = None
                state.task = None
                state.zero_request = None
                if state.step_number <= progress.steps_called:  # counted among its step's updates
                    self._updater.snapshots.take(state.step_number, state.group)
                progress.set_stage(state, IDLE)
            progress.cond.notify_all()

    def communicated(self, state: ParamState, done: Any) -> None:
        """The scheduler's completion of ``state``'s task (``done``, a finished future)."""
        error = done.exception()
        progress = self._progress
        with progress.cond:
            if error is None and state.grad._version != state.version + state.task.writes:
                error = GradientError(
                    f"the gradient of {state.name!r} was modified in place while it was being "
                    "communicated; read or change gradients only after optimizer.synchronize() (reading "
                    "p.grad on the training thread waits by itself)"
                )
            if error is not None:
                progress.fail(error)
                return
            state.task = None  # done with it (the scheduler has released its payload)
            if state.discard:
                progress.set_stage(state, IDLE)
            else:
                progress.set_stage(state, COMMUNICATED)
                self._updater.add(state)
            progress.cond.notify_all()
