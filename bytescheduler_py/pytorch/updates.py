"""Applying updates: the user's own update rule, one parameter (or a batch) at a time.

:class:`Updater` is the :class:`~bytescheduler.pytorch.overlap.OverlapEngine`'s thread that
applies each parameter's update once its gradient is averaged and its step was called,
with that step's hyperparameters (:class:`Snapshots`), several parameters per call
(:func:`batches`). :func:`sub_optimizer` and :func:`full_optimizer` are instances of the
user's optimizer class over one parameter or over all, without its step hooks.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List

import torch

_WAIT_SLICE = 0.5  # seconds between checks for errors while waiting


def _without_hooks(optimizer: torch.optim.Optimizer, base: type, skip: set) -> torch.optim.Optimizer:
    """An instance of ``base`` with ``optimizer``'s attributes but ``skip`` and its step hooks."""
    sub = base.__new__(base)
    sub.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in skip})
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if hooks in optimizer.__dict__:
            setattr(sub, hooks, OrderedDict())
    return sub


def sub_optimizer(optimizer: torch.optim.Optimizer, base: type, param: torch.nn.Parameter, group: dict):
    """A private instance of the user's optimizer class over one parameter, sharing its state.

    Built without calling ``__init__`` (custom optimizers may take other arguments), from
    the user's instance attributes, with its hooks and any instance-level patches (e.g. the
    LR scheduler's step counter) left out, so one parameter's update runs the user's own
    update rule exactly as the full ``step()`` would.
    """
    sub = _without_hooks(optimizer, base, {"param_groups", "state", "step", "zero_grad", "_bytescheduler"})
    sub.param_groups = [dict(group, params=[param])]
    sub.state = optimizer.state
    return sub


def full_optimizer(optimizer: torch.optim.Optimizer, base: type) -> torch.optim.Optimizer:
    """An instance of the user's class over all of ``optimizer``'s groups and state, without
    its step hooks (the wrapped ``step()`` runs those once), for one full update."""
    return _without_hooks(optimizer, base, {"step", "zero_grad", "_bytescheduler"})


class Snapshots:
    """The hyperparameters in force at each called step, kept until its last update used them.

    The user may change the learning rate (an LR scheduler) while earlier steps' updates
    are still pending; each update must use its own step's values.
    """

    def __init__(self) -> None:
        self._groups: Dict[int, List[dict]] = {}
        self._users: Dict[int, int] = {}

    def record(self, step: int, param_groups: List[dict], users: int) -> None:
        if users:
            self._groups[step] = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
            self._users[step] = users

    def take(self, step: int, group: int, count: int = 1) -> dict:
        """``count`` parameters' updates of ``step`` use the values of their ``group`` (and let go of them)."""
        values = self._groups[step][group]
        self._users[step] -= count
        if not self._users[step]:
            del self._groups[step], self._users[step]
        return values


class Updater:
    """The thread that applies due updates, in batches, then makes their parameters IDLE.

    ``progress`` is the engine's shared state (:class:`~bytescheduler.pytorch.progress.Progress`):
    its lock guards the averaged parameters waiting here (:meth:`add`), which are due once
    their step was called. ``recorder``: the compute timeline, given the time of each batch.
    The thread ends when the engine closes or fails.
    """

    def __init__(self, progress: Any, recorder: Any = None) -> None:
        self._progress = progress
        self._recorder = recorder
        self.snapshots = Snapshots()
        self._ready: List[Any] = []
        self._thread = threading.Thread(target=self._run, name="bytescheduler-update", daemon=True)
        self._thread.start()

    def add(self, state: Any) -> None:
        """``state``'s gradient is averaged: update it once its step is called (lock held)."""
        self._ready.append(state)

    def drop_discarded(self) -> None:
        """Forget the averaged parameters whose update was discarded (lock held)."""
        self._ready = [s for s in self._ready if not s.discard]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def _due(self) -> List[Any]:
        """Wait for due updates; none once the engine closed or failed."""
        progress = self._progress
        with progress.cond:
            while not (progress.latch or progress.closed):
                due = [s for s in self._ready if s.step_number <= progress.steps_called]
                if due:
                    self._ready = [s for s in self._ready if s.step_number > progress.steps_called]
                    return due
                progress.cond.wait(_WAIT_SLICE)
        return []

    def _run(self) -> None:
        progress = self._progress
        while True:
            due = self._due()
            if not due:
                return
            try:
                for batch in batches(due):
                    first = batch[0]
                    with progress.cond:
                        values = self.snapshots.take(first.step_number, first.group, len(batch))
                    start = time.perf_counter() if self._recorder is not None else 0.0
                    batch_optimizer(batch, values).step()
                    if self._recorder is not None:
                        self._recorder.update(start, time.perf_counter(),
                                              sum(s.param.numel() * s.param.element_size() for s in batch))
                    self._applied(batch)
            except BaseException as error:  # noqa: BLE001 - surfaces in the training thread
                with progress.cond:
                    progress.fail(error)
                return

    def _applied(self, batch: List[Any]) -> None:
        """``batch`` was updated: its deferred ``zero_grad``, then its parameters are IDLE."""
        progress = self._progress
        with progress.cond:
            for state in batch:
                if state.zero_request is not None:
                    zero_gradient(state.param, state.zero_request)
                    state.zero_request = None
                state.grad = None
                progress.set_idle(state)
            progress.cond.notify_all()


# Parameters updated in one call of the update rule: few calls on small models, while on
# large ones the first layers' updates (the next forward's first need) do not wait for all.
BATCH_ELEMENTS = 1 << 20


def batches(due: List[Any]) -> List[List[Any]]:
    """``due`` in forward order, cut where the group or step changes or a batch grows large.

    The user's update rule treats each parameter on its own (as per-parameter updates
    already require), so updating several in one call gives the same numbers with one
    call's Python overhead.
    """
    batches: List[List[Any]] = []
    size = 0
    for state in sorted(due, key=lambda s: (s.step_number, s.priority)):
        numel = state.param.numel()
        last = batches[-1] if batches else None
        if (last is None or last[0].group != state.group or last[0].step_number != state.step_number
                or size + numel > BATCH_ELEMENTS):
            batches.append([state])
            size = numel
        else:
            last.append(state)
            size += numel
    return batches


def batch_optimizer(batch: List[Any], values: dict) -> torch.optim.Optimizer:
    """The per-parameter optimizer of ``batch[0]`` over every parameter of ``batch``, with ``values``."""
    if len(batch) == 1:
        sub = batch[0].sub
        sub.param_groups[0].update(values)
        return sub
    first = batch[0].sub
    sub = type(first).__new__(type(first))  # not copy.copy: Optimizer.__getstate__ keeps three fields only
    sub.__dict__.update(first.__dict__)  # shares the optimizer's state
    sub.param_groups = [dict(values, params=[state.param for state in batch])]
    return sub


def zero_gradient(param: torch.nn.Parameter, set_to_none: bool) -> None:
    """What ``Optimizer.zero_grad`` does to one parameter."""
    if param.grad is None:
        return
    if set_to_none:
        param.grad = None
    else:
        if param.grad.grad_fn is not None:
            param.grad.detach_()
        else:
            param.grad.requires_grad_(False)
        param.grad.zero_()
