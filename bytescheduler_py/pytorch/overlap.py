"""Cross-iteration overlap: update each parameter as soon as its gradient is averaged.

The :class:`OverlapEngine` is what :func:`bytescheduler.pytorch.ScheduledOptimizer` (and
its Horovod twin) run on:

1. a gradient hook (``register_post_accumulate_grad_hook``) submits each parameter's
   gradient to the scheduler as soon as backward has accumulated it;
2. ``step()`` only records the hyperparameters in force and returns; an updater thread
   applies the user's own optimizer to each parameter once its gradient is averaged and
   its step was called;
3. the next iteration waits only where it must: a module's forward pre-hook waits for the
   module's own parameters, and a read guard (a ``TorchFunctionMode`` on the training
   thread) waits at the first operation that reads any parameter whose update is pending,
   so tied weights and parameters used outside their module's forward are covered too.
   Reading a gradient that is still being communicated (``p.grad``, e.g. by
   ``torch.nn.utils.clip_grad_norm_``) waits for its communication: clipping by global
   norm therefore falls back to a barrier and stays correct.

Each parameter moves IDLE -> QUEUED (submitted) -> COMMUNICATED -> (step called, update
applied) -> IDLE.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..core import Scheduler
from ..core.errors import SchedulerClosed
from ..core.modes import PLAIN, ModeChooser
from .adaptive import ModeSwitch, PlainSetup
from .compute_timeline import ComputeTimeline
from .errors import AGAIN, GradientError, check_arguments
from .heap import raise_malloc_thresholds
from .module_waits import ModuleWaits
from .params import COMMUNICATED, IDLE, ParamHooks, ParamState
from .progress import Progress
from .rounds import Rounds
from .transfers import Transfers
from .read_guard import ReadGuard, suspended
from .sparse import Average, SparseParams
from .unused import Absence, AbsentGradients
from .updates import Updater, zero_gradient


class OverlapEngine:
    """Schedules each parameter's gradient and applies its update as soon as it is averaged.

    Args:
        model: the module trained (for forward pre-hooks and forward order).
        optimizer: the user's optimizer; its param_groups and state are used directly.
        base: the user's optimizer class (the update rule).
        scheduler: the core scheduler that moves gradients.
        world_size: the number of ranks averaged over.
        prescale: divide each gradient by ``world_size`` before communicating (the backend
            sums); False when the backend averages itself.
        backward_passes_per_step: backward passes accumulated locally before communicating.
        guard_reads: install the read guard on the constructing thread.
        timeout: seconds to wait for one parameter before raising.
        plain: the framework's own path, for the adaptive mode switch
            (:mod:`bytescheduler.pytorch.adaptive`); None: always scheduled.
        sparse: the collective that sums a sparse gradient over the ranks
            (:mod:`bytescheduler.pytorch.sparse`); None: a model with sparse gradients is
            refused with :class:`GradientError`.
        absence: the rule for a parameter without a gradient on some rank at ``step()``
            (:mod:`bytescheduler.pytorch.unused`): DDP's or Horovod's; None (one rank
            alone): such a parameter is left out.
        on_step: called at the start of every ``step()`` (the buffers' sync counts steps).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        base: type,
        scheduler: Scheduler,
        world_size: int,
        prescale: bool,
        backward_passes_per_step: int = 1,
        guard_reads: bool = True,
        timeout: float = 300.0,
        on_close: Optional[Callable[[], None]] = None,
        plain: Optional[PlainSetup] = None,
        sparse: Optional[Average] = None,
        absence: Optional[Absence] = None,
        on_step: Optional[Callable[[], None]] = None,
    ) -> None:
        check_arguments(model, optimizer, backward_passes_per_step)
        self.scheduler = scheduler
        self.backward_passes_per_step = backward_passes_per_step
        self.optimizer = optimizer  # the user's: its param_groups and state are used directly
        self.base = base  # the user's optimizer class: the update rule
        self._on_close = on_close
        self._on_step = on_step
        self.progress = Progress(scheduler, timeout)
        self._cond = self.progress.cond
        self.shadowed = 0  # shadow rounds run (join.py, horovod_join.py)
        self.guard_thread: Optional[int] = None
        self._sparse = SparseParams(model, sparse, world_size, prescale)
        self._params = ParamHooks(model, optimizer, base, self._sparse, self.progress.check_accumulate,
                                  self._on_gradient)
        self.states: Dict[int, ParamState] = self._params.states
        self.guard_reads = guard_reads
        self._plain = False  # the plain path runs (set_plain)
        self.sampling = None  # rank 0's warm-up sampler, while a step is sampled (adaptive.WarmupSampler)
        self._switch = None if plain is None else ModeSwitch(plain, scheduler.rank, self.states,
                                                             backward_passes_per_step, absence=absence,
                                                             progress=self.progress)
        self._module_waits = ModuleWaits(model, self.states, self.progress)
        self._module_waits.install()  # the scheduled path's (hook_for_schedule)
        # With a timeline, the compute too (for `bytescheduler simulate --trace`); else no hook.
        self.compute_timeline: Optional[ComputeTimeline] = None
        if scheduler.timeline is not None:
            self.compute_timeline = ComputeTimeline(model, scheduler.timeline)
            for handle in self.compute_timeline.handles:
                self._params.keep(handle)
        # Gradients are freed while the next forward runs; keep glibc from returning their
        # memory to the kernel each time (see heap.py: ~5,000 page faults per iteration).
        raise_malloc_thresholds()
        self._updates = Updater(self.progress, self.compute_timeline)
        self.transfers = Transfers(self.progress, scheduler, self._updates, world_size, prescale)
        self._rounds = Rounds(self.progress, self.states, self._submit, self._irregular)
        self._rounds.absence = None if absence is None else AbsentGradients(self, absence)
        ReadGuard.attach(self, install=guard_reads)
        if self._switch is not None and self._switch.chooser.mode == PLAIN:
            self._switch.apply(self)  # a plan chose the framework's own path: start on it

    # ------------------------------------------------------------------ registration

    def add_param_group(self, group_index: int) -> None:
        """Register the parameters of a group the user added after construction."""
        self._params.register(group_index)
        if self._switch is not None:
            self._switch.rebuild()

    def refresh_state(self) -> None:
        """Re-point the per-parameter optimizers at the optimizer's state (after load_state_dict)."""
        for state in self.states.values():
            state.sub.state = self.optimizer.state

    # ------------------------------------------------------------------ gradients

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        state = self.states[id(param)]
        if state.sparse:
            return  # averaged at step()
        if self.plain:
            if not self._switch.route.gradient(state):
                raise GradientError(AGAIN.format(state.name))
            return
        if self.sampling is not None:
            self.sampling.gradient(state.param)
        with self._cond:
            state.passes += 1
            if state.passes < self.backward_passes_per_step:
                return
            self._rounds.opened()
        self._submit(state)

    def _submit(self, state: ParamState) -> None:
        grad = self.transfers.prepared(state)
        if grad is None:
            return
        with self._cond:
            self.transfers.queue(state, grad, self.progress.steps_called + 1, self._rounds.count + 1)
        self.transfers.schedule(state)

    # ------------------------------------------------------------------ step

    def step(self) -> None:
        """Record this step's hyperparameters; updates follow as gradients arrive."""
        if self.sampling is not None:
            self.sampling.end()
        self.progress.latch.raise_if_set()
        if self._on_step is not None:
            self._on_step()
        if self.compute_timeline is not None:
            self.compute_timeline.step_called()
        if self.progress.closed:
            raise SchedulerClosed(
                "step() after close(): this ScheduledOptimizer no longer communicates, so the step "
                "would update from this rank's gradients alone; create a new ScheduledOptimizer "
                "(close() belongs after the last step)")
        if self.plain:
            self._switch.plain_step(self)
            return
        self.finish_backward()
        self.average_sparse(apply=True)
        with self._cond:
            step = self.progress.count_step()
            users = sum(1 for s in self.states.values() if s.stage != IDLE and s.step_number == step)
            self._updates.snapshots.record(step, self.optimizer.param_groups, users)
        # Backward is over: nothing more will come to merge with what is queued.
        self.scheduler.end_burst()
        self.scheduler.step_boundary()
        if self._switch is not None:
            self._switch.end_step(self)

    def finish_backward(self, shadow: bool = False) -> None:
        """End the coming step's round (:meth:`~bytescheduler.pytorch.rounds.Rounds.finish`)."""
        self._rounds.finish(shadow)

    def end_plain_round(self) -> None:
        """A round on the plain path (its ``step()``), counted like the others."""
        self._rounds.end_plain()

    @property
    def rounds(self) -> int:
        """Rounds ended, one per step's backward (the same count on every rank)."""
        return self._rounds.count

    def set_round_notice(self, notice: Optional[Callable[[], None]]) -> None:
        """Call ``notice()`` at the end of each round of this rank's own (a join context's, :mod:`.join`)."""
        self._rounds.notice = notice

    def _irregular(self) -> None:
        """A step whose backward left some parameters out: the mode switch does not time it."""
        if self._switch is not None:
            self._switch.irregular = True

    @property
    def steps_taken(self) -> int:
        """The steps this rank took part in: ``step()`` calls and shadow rounds (the same
        count on every rank between steps)."""
        return self.progress.steps_called + self.shadowed

    def shadow_round(self) -> None:
        """This rank is out of data (:mod:`.join`, :mod:`.horovod_join`): take part in the
        others' round with zeros for every gradient, drop the averages and update nothing."""
        self.shadowed += 1
        self.zero_grad(set_to_none=True)
        if self.plain:
            self._switch.shadow_step(self)
        else:
            self.finish_backward(shadow=True)
            self.scheduler.end_burst()
            with self._cond:
                self.progress.wait(lambda: all(s.stage == IDLE for s in self.states.values()), "the others' round")
            self.zero_grad(set_to_none=True)
            self._irregular()
            if self._switch is not None:
                self._switch.end_step(self)

    def average_sparse(self, apply: bool) -> None:
        """Average the sparse gradients now (every rank at the same step); with ``apply``,
        update those parameters too, with this step's hyperparameters."""
        with suspended():
            self._sparse.step(self.states.values(), self.optimizer.param_groups, apply)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients now, or right after a pending update (which still needs them)."""
        with self._cond:
            discarded = []
            for state in self.states.values():
                if state.stage == IDLE:
                    continue
                if state.step_number > self.progress.steps_called:
                    # Communicated for a step that will not come: drop the update.
                    state.discard = True
                    discarded.append(state)
                else:
                    state.zero_request = set_to_none
            self._updates.drop_discarded()
            for state in discarded:
                if state.stage == COMMUNICATED:
                    self.progress.set_stage(state, IDLE)
            if discarded:
                self._rounds.restart()
            self.progress.wait(lambda: all(s.stage == IDLE for s in discarded), "discarded gradients")
            zero_now = [s for s in self.states.values() if s.stage == IDLE]
        with suspended():
            for state in zero_now:
                zero_gradient(state.param, set_to_none)

    def synchronize(self) -> None:
        """Wait for every gradient in flight and every update of the steps called so far
        (after a backward: its gradients, zeros for those it did not produce included)."""
        if not self.plain and self._rounds.unfinished():
            self.finish_backward()
        with self._cond:
            self.progress.wait(
                lambda: all(s.stage == IDLE or (s.stage == COMMUNICATED and s.step_number > self.progress.steps_called)
                            for s in self.states.values()),
                "pending updates",
            )

    # ------------------------------------------------------------------ waiting

    def wait_if_pending(self, tensor: torch.Tensor, gradient_only: bool) -> None:
        """Block while ``tensor`` is one of our parameters with a pending update (the read guard)."""
        state = self.states.get(id(tensor))
        if state is None:
            return
        if gradient_only and self._rounds.unfinished():
            self.finish_backward()  # every gradient is read averaged, as after DDP's backward
        if state.stage != IDLE:
            self.wait_readable(state, gradient_only)

    def wait_readable(self, state: ParamState, gradient_only: bool = False) -> None:
        """Block until ``state``'s parameter (``gradient_only``: its gradient) may be read on the training thread."""
        self.progress.wait_readable(state, gradient_only)

    def hook_for_schedule(self, on: bool) -> None:
        """Hook (or unhook) what only the scheduled path needs on the training thread: the
        pre-accumulation check of each parameter and the modules' forward pre-hooks. On the
        plain path every update is done when ``step()`` returns, so neither has anything to
        do, and a module with no hook at all runs torch's fast call path (on a small model,
        a Python call per module and per parameter is measurable)."""
        self._params.check_accumulation(on)
        (self._module_waits.install if on else self._module_waits.remove)()

    @property
    def plain(self) -> bool:
        """True while the framework's own path runs (:mod:`bytescheduler.pytorch.adaptive`)."""
        return self._plain

    def set_plain(self, plain: bool) -> None:
        """Run the framework's own path (or the schedule again): the flag ``step()`` and the
        gradient hooks read, and the training thread's hooks (:meth:`hook_for_schedule`)."""
        self._plain = plain
        self.hook_for_schedule(not plain)

    @property
    def chooser(self) -> Optional[ModeChooser]:
        """The mode switch's :class:`~bytescheduler.core.modes.ModeChooser` (the same on every
        rank; its ``history`` is the mode of every step), or None without a mode switch."""
        return None if self._switch is None else self._switch.chooser

    @property
    def busy(self) -> int:
        """Parameters with an update or communication pending (the read guard's fast check)."""
        return self.progress.busy

    # ------------------------------------------------------------------ shutdown

    def close(self, wait: bool = True) -> None:
        """Finish (``wait=True``) or abandon pending work, stop threads and remove hooks."""
        with self._cond:
            if self.progress.closed:
                return
        try:
            if self._switch is not None:
                self._switch.close()
            if wait and not self.progress.latch:
                self.synchronize()
        finally:
            with self._cond:
                for state in self.states.values():
                    self.progress.set_idle(state)
                self.progress.close()
            self._updates.join(timeout=30)
            self._params.remove()  # the parameters' hooks and checks
            self._module_waits.remove()
            ReadGuard.detach(self)
            try:
                self.scheduler.stop(wait=wait and not self.progress.latch)
            finally:
                if self._on_close is not None:
                    self._on_close()
