"""The mode switch of an :class:`~bytescheduler.pytorch.overlap.OverlapEngine`.

With ``adaptive`` on (ScheduledOptimizer's default), rank 0's
:class:`~bytescheduler.core.modes.ModeChooser` times steps of the scheduled path and of the
plain path (:mod:`bytescheduler.pytorch.plain`: the framework's own buckets and one full
``step()``), keeps the faster and re-tries the other now and then. Every rank runs the
same chooser; at its decision points one small collective carries rank 0's proposal and
each rank's veto (a rank that saw a parameter without a gradient at some step stops the
switching for good: the plain path then completes its buckets with zeros at ``step()``,
see :mod:`bytescheduler.pytorch.unused`, so its times no longer tell a regular step's).
A switch happens inside ``step()``, on every rank at the same step, after the scheduled
path has drained, so the two paths never overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from ..core.log import logger as log
from ..core.modes import PLAIN, ModeDriver, ModeSwitchParams, Phase, new_chooser
from ..core.startup import BUCKET_BYTES, FIRST_BUCKET_BYTES, StartupPredictor, StepSample
from .grad_views import hand_over
from .params import dense_gradient
from .plain import PlainPath, Reducer, assign_buckets
from .unused import Absence
from .read_guard import ReadGuard, suspended
from .updates import full_optimizer


class FrameworkHooks(Protocol):
    """A framework's own gradient hooks, which can run the plain path themselves (Horovod's
    ``DistributedOptimizer``): then our gradient hook only marks the backward's end (where
    :meth:`finish` runs), and the plain path costs about what the framework's does."""

    def enter(self) -> None:
        """From the next backward on, the framework's hooks communicate."""

    def leave(self) -> None:
        """They stop communicating (called between steps, with nothing in flight)."""

    def finish(self, launched_only: bool = False) -> None:
        """Wait (with a deadline) for what they launched and leave the averages as gradients
        (``launched_only``: and do nothing if they launched nothing)."""

    def close(self) -> None:
        """Stop what :meth:`finish` started (at the engine's close, after the last finish)."""


@dataclass
class PlainSetup:
    """What an adapter gives the engine for the plain mode.

    reducer: the framework's collective over buckets.
    agree: ``agree(proposal, veto) -> decision``, collective: rank 0's proposal, or
        :data:`~bytescheduler.core.modes.STOP` if any rank vetoes.
    first_bytes, bucket_bytes: bucket sizes (0: one gradient per bucket, for Horovod,
        whose background thread fuses by itself).
    grad_views: large averages become the parameters' gradients as views of the reducer's
        buffer instead of being copied back (:mod:`~bytescheduler.pytorch.grad_views`).
    start_plain: start on this path (``SchedulerConfig.start_plain``, a plan's advice).
    mode_switch: the mode switch's parameters (``SchedulerConfig.mode_switch``; None: defaults).
    hooks: the framework's own hooks, which run the plain path instead of ``reducer``
        (whose buckets are then not used).
    """

    reducer: Reducer
    agree: Callable[[int, bool], int]
    first_bytes: int = FIRST_BUCKET_BYTES
    bucket_bytes: int = BUCKET_BYTES
    grad_views: bool = False
    start_plain: bool = False
    mode_switch: Optional[ModeSwitchParams] = None
    hooks: Optional[FrameworkHooks] = None


class BucketRoute:
    """The plain path on our buckets: our gradient hook hands each complete gradient to a
    :class:`~bytescheduler.pytorch.plain.PlainPath` over the adapter's reducer (DDP's layout)."""

    def __init__(self, setup: PlainSetup, rank: int, states: Dict[int, Any], passes: int,
                 absence: Optional[Absence] = None) -> None:
        self._setup = setup
        self._rank = rank
        self._states = states
        self._passes = passes
        self._absence = absence
        self.rebuild()

    def gradient(self, state: Any) -> bool:
        """Backward accumulated ``state``'s gradient (a dense parameter; the training thread,
        which alone touches the plain path; the engine's gradient hook calls this directly).
        False when it already went this iteration (a second backward without accumulation)."""
        state.passes += 1
        if state.passes < self._passes:
            return True
        state.passes = 0
        path = self.path
        if path.taken(state.key):
            return False
        grad = state.param.grad
        if grad is not None:
            if grad.is_sparse or not grad.is_contiguous():
                grad = dense_gradient(state)  # as backward left it: the reducer scales
            path.add(state.key, grad)
        return True

    def finish(self) -> bool:
        return self.path.finish()

    def shadow(self) -> None:
        """A round without gradients (a rank out of data): every bucket goes with zeros."""
        self.path.finish()

    def close(self) -> None:
        self.path.wait_launched()

    def enter(self) -> None:
        """Nothing to switch on: our gradient hook feeds the buckets while the plain mode runs."""

    def leave(self) -> None:
        """Nothing to switch off (see :meth:`enter`)."""

    def rebuild(self) -> None:
        """Lay the buckets out again over every parameter (after ``add_param_group``).

        DDP's layout: reverse forward order, cut by size and by dtype and device."""
        ordered = sorted((s for s in self._states.values() if not s.sparse), key=lambda s: (s.priority, s.key))
        by_key = {state.key: state for state in ordered}
        members = [(s.key, s.param.numel() * s.param.element_size(), (s.param.dtype, s.param.device))
                   for s in reversed(ordered)]
        buckets = assign_buckets(members, self._setup.first_bytes, self._setup.bucket_bytes)
        assign = None
        if self._setup.grad_views:
            assign = lambda key, view: key in by_key and hand_over(by_key[key].param, view)  # noqa: E731
        zeros = unused = None
        if self._absence is not None:
            zeros = lambda key: _zero_gradient(by_key[key].param)  # noqa: E731
            if self._absence is Absence.DDP:
                unused = lambda keys: _forget_gradients(by_key[key].param for key in keys)  # noqa: E731
        self.path = PlainPath(buckets, self._setup.reducer, lambda key: dense_gradient(by_key[key]), self._rank, assign,
                              zeros, unused)


class HookRoute:
    """The plain path on the framework's own hooks (:class:`FrameworkHooks`): they launch
    every all-reduce; our gradient hook only queues a callback for the backward's end, where
    the averages are put in place once the passes to accumulate are done."""

    def __init__(self, hooks: FrameworkHooks, passes: int) -> None:
        self._hooks = hooks
        self._passes = passes
        self._queued = False  # a callback is queued for this backward's end
        self._passes_seen = 0  # backward passes ended since the last step

    def gradient(self, state: Any) -> bool:
        """As :meth:`BucketRoute.gradient`: queue the end-of-backward callback once."""
        if self._passes_seen >= self._passes:
            return False  # a backward after the accumulation was complete, before step()
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        return True

    def _backward_done(self) -> None:
        """At the end of a backward pass (after every hook ran): once the passes to accumulate
        are done, wait for their all-reduces and put the averages in place, so that gradients
        read after backward are averaged, as on our buckets (and DDP's)."""
        self._queued = False
        self._passes_seen += 1
        if self._passes_seen == self._passes:
            self._hooks.finish()

    def finish(self) -> bool:
        if 0 < self._passes_seen < self._passes:  # fewer passes than to accumulate
            self._hooks.finish()  # average what was accumulated
        self._queued = False
        self._passes_seen = 0
        return True

    def shadow(self) -> None:
        """A round without gradients (a rank out of data): the framework's ``synchronize``
        all-reduces zeros for every parameter without one."""
        self._queued = False
        self._passes_seen = 0
        self._hooks.finish()

    def close(self) -> None:
        try:
            self._hooks.finish(launched_only=True)
        finally:
            self._hooks.leave()
            self._hooks.close()

    def enter(self) -> None:
        self._hooks.enter()

    def leave(self) -> None:
        self._hooks.leave()

    def rebuild(self) -> None:
        """Nothing to lay out: the framework's hooks cover every parameter themselves."""


class ModeSwitch:
    """Chooses the mode at each step's end and runs the plain path while it is chosen.

    Args:
        setup: the adapter's reducer and agreement.
        rank: this process's rank (rank 0 decides: it times its steps and proposes).
        states: the engine's parameter states (``key``, ``param``, ``priority``), live.
        passes: backward passes accumulated before a gradient counts as complete.

    The plain path runs on the framework's own hooks where the adapter has them
    (:class:`HookRoute`), else on our buckets (:class:`BucketRoute`); both take each
    gradient from our hook (``route.gradient``, called by the engine without a detour
    through the switch: it runs once per gradient), finish at ``step()`` and switch on and
    off between steps (``enter``, ``leave``).
    """

    def __init__(self, setup: PlainSetup, rank: int, states: Dict[int, Any], passes: int,
                 clock: Callable[[], float] = time.perf_counter, absence: Optional[Absence] = None,
                 progress: Any = None) -> None:
        leader = rank == 0
        self.chooser = new_chooser(setup.mode_switch, setup.start_plain)
        # After the warm-up, start on the path a model predicts to win (core.startup); with
        # accumulation the warm-up's steps are several backward passes each: not modelled.
        self.startup: Optional[StartupPredictor] = None
        self._sampler: Optional[WarmupSampler] = None
        if self.chooser.params.predict and self.chooser.phase == Phase.WARMUP and passes == 1 and progress is not None:
            dense = [s.param for s in states.values() if not s.sparse]
            self.startup = StartupPredictor(
                _probe_on(setup.reducer, dense[0].device if dense else torch.device("cpu")),
                sum(p.numel() * p.element_size() for p in dense), leader,
                setup.first_bytes or FIRST_BUCKET_BYTES, setup.bucket_bytes or BUCKET_BYTES,  # Horovod fuses
                report=lambda prediction: log.info("rank 0: %s", prediction.text()))
            if leader:
                self._sampler = WarmupSampler(progress, self.startup)
        self._driver = ModeDriver(self.chooser, leader, setup.agree, clock, rank, startup=self.startup)
        self.route = (BucketRoute(setup, rank, states, passes, absence) if setup.hooks is None
                      else HookRoute(setup.hooks, passes))
        self.irregular = False  # a parameter had no gradient at some step on this rank

    def close(self) -> None:
        """At the engine's close: wait for what the plain path launched; the framework's own
        hooks stop communicating."""
        self.route.close()

    def rebuild(self) -> None:
        """After ``add_param_group``: the plain path covers the new parameters too."""
        self.route.rebuild()

    def plain_step(self, engine: Any) -> None:
        """The plain mode's ``step()``: finish the buckets, then one full update with the user's rule."""
        engine.end_plain_round()
        if not self.route.finish():
            self.irregular = True
        engine.average_sparse(apply=False)  # the full step below updates those parameters too
        with engine.progress.cond:
            engine.progress.count_step()
        full_optimizer(engine.optimizer, engine.base).step()
        self.end_step(engine)

    def shadow_step(self, engine: Any) -> None:
        """A rank out of data (:mod:`.join`) on the plain path: every bucket with zeros, the
        averages dropped, no update; then the step's end as everywhere (it vetoes switching)."""
        with suspended():
            for state in engine.states.values():
                state.param.grad = None
            self.route.shadow()
            for state in engine.states.values():
                state.param.grad = None
        self.irregular = True
        self.end_step(engine)

    def end_step(self, engine: Any) -> None:
        """At the end of every ``step()``: time it (rank 0), agree at decision points, switch.

        Before any collective of ours and before switching away from the scheduled path,
        the engine drains (``synchronize()``), so the two paths never overlap.
        """
        old = self.chooser.mode
        new = self._driver.end_step(engine.synchronize, self.irregular)
        if new != old:
            self.apply(engine)
        if self._sampler is not None:  # rank 0: time the warm-up's next step
            warming = self.chooser.phase == Phase.WARMUP and not engine.plain
            engine.sampling = self._sampler.begin() if warming else None
            if not warming:
                self._sampler = None

    def apply(self, engine: Any) -> None:
        """Put ``engine`` on the chooser's mode: its flag, its hooks and the read guard (which
        the plain path, where every update is done when ``step()`` returns, does not need)."""
        engine.set_plain(self.chooser.mode == PLAIN)
        (self.route.enter if engine.plain else self.route.leave)()
        if engine.plain:
            ReadGuard.detach(engine)  # popped if on top: torch calls no longer go through it
        else:
            ReadGuard.attach(engine, install=engine.guard_reads)
            _own_gradients(engine.states.values())


class WarmupSampler:
    """Rank 0's warm-up steps after the first, for the start-up prediction: when each
    gradient arrived, and the compute before and after the first one, the training
    thread's waits (:attr:`~bytescheduler.pytorch.progress.Progress.blocked_s`) left out.

    The engine calls :meth:`gradient` from its gradient hook while a step is sampled
    (``engine.sampling``) and :meth:`end` when ``step()`` is called."""

    def __init__(self, progress: Any, startup: StartupPredictor) -> None:
        self._progress = progress
        self._startup = startup
        self._ready: List[Tuple[float, int]] = []
        self._began = self._blocked = self._first_blocked = 0.0

    def begin(self) -> "WarmupSampler":
        self._ready = []
        self._began, self._blocked = time.perf_counter(), self._progress.blocked_s
        return self

    def gradient(self, param: torch.Tensor) -> None:
        blocked = self._progress.blocked_s
        if not self._ready:
            self._first_blocked = blocked
        # when it arrived on the backward's own clock: the waits since the first one left out
        arrived = time.perf_counter() - (blocked - self._first_blocked)
        self._ready.append((arrived, param.numel() * param.element_size()))

    def end(self) -> None:
        """``step()`` was called: the backward is over."""
        ready, self._ready = self._ready, []
        if not ready:
            return
        first = ready[0][0]
        forward = first - self._began - (self._first_blocked - self._blocked)
        backward = time.perf_counter() - first - (self._progress.blocked_s - self._first_blocked)
        self._startup.add(StepSample(forward, backward, [(t - first, nbytes) for t, nbytes in ready]))


def _probe_on(reducer: Reducer, device: torch.device) -> Callable[[int, int], None]:
    """The start-up probe's all-reduce, on the framework's own collective (the plain path's)."""
    def all_reduce(key: int, nbytes: int) -> None:
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        reducer.wait(reducer.start([(-1 - key, tensor)]))

    return all_reduce


def _own_gradients(states: Any) -> None:
    """Back to the scheduled path: a gradient the plain path left as a view of its buffer
    (:mod:`~bytescheduler.pytorch.grad_views`; kept by ``zero_grad(set_to_none=False)``)
    gets memory of its own, since the schedule tells in-place changes of a gradient by its
    version counter, which views of one buffer share."""
    for state in states:
        grad = state.param.grad
        if grad is not None and grad._base is not None:
            state.param.grad = grad.clone()


def _zero_gradient(param: torch.Tensor) -> torch.Tensor:
    """A zero gradient for ``param``, which had none this step (see :mod:`.unused`)."""
    param.grad = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    return param.grad


def _forget_gradients(params: Any) -> None:
    """No rank had a gradient for ``params``: they keep none, as DDP leaves them."""
    for param in params:
        param.grad = None

