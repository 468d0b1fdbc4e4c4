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

import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from ..core import Scheduler, Task
from ..core.errors import CommunicationTimeout, ErrorLatch, SchedulerClosed
from ..core.log import logger
from ..core.modes import PLAIN
from .adaptive import ModeSwitch, PlainSetup
from .compute_timeline import ComputeTimeline
from .errors import AGAIN, GradientError, check_arguments, undeclared_sparse
from .heap import raise_malloc_thresholds
from .params import COMMUNICATED, IDLE, QUEUED, ParamHooks, ParamState
from .read_guard import ReadGuard, suspended
from .sparse import Average, SparseParams
from .unused import Absence, AbsentGradients
from .updates import Updater, zero_gradient

_WAIT_SLICE = 0.5  # seconds between checks for errors while waiting


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
        self.world_size = world_size
        self.prescale = prescale
        self.backward_passes_per_step = backward_passes_per_step
        self.timeout = timeout
        self._optimizer = optimizer
        self._base = base
        self._on_close = on_close
        self._on_step = on_step
        self._cond = threading.Condition(threading.Lock())
        self._steps_called = 0
        # finish_backward(): the rounds it ended (the same count on every rank), whether
        # backward submitted something since, and the step it ended a round for.
        self.rounds = 0
        self._round_open = False
        self._finished_step = 0
        self.round_notice: Optional[Callable[[], None]] = None  # the join context's (join.py)
        self.shadowed = 0  # shadow rounds run (join.py, horovod_join.py)
        self._latch = ErrorLatch()
        self._closed = False
        self.busy = 0  # parameters not IDLE (the read guard's fast check), under _cond
        self.guard_thread: Optional[int] = None
        self._sparse = SparseParams(model, sparse, world_size, prescale)
        self._params = ParamHooks(model, optimizer, base, self._sparse, self._check_accumulate, self._on_gradient)
        self.states: Dict[int, ParamState] = self._params.states
        self.guard_reads = guard_reads
        self.plain = False  # the plain path runs (see adaptive.py)
        self._switch = None if plain is None else ModeSwitch(plain, scheduler.rank, self.states,
                                                             backward_passes_per_step, absence=absence)
        self._model = model
        self._module_hooks: List = []  # the modules' forward pre-hooks (scheduled mode only)
        self._hook_modules()
        # With a timeline, the compute too (for `bytescheduler simulate --trace`); else no hook.
        self.compute_timeline: Optional[ComputeTimeline] = None
        if scheduler.timeline is not None:
            self.compute_timeline = ComputeTimeline(model, scheduler.timeline)
            for handle in self.compute_timeline.handles:
                self._params.keep(handle)
        # Gradients are freed while the next forward runs; keep glibc from returning their
        # memory to the kernel each time (see heap.py: ~5,000 page faults per iteration).
        raise_malloc_thresholds()
        self._updates = Updater(self)
        self._absence = None if absence is None else AbsentGradients(self, absence)
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
            state.sub.state = self._optimizer.state

    # ------------------------------------------------------------------ gradients

    def _set_stage(self, state: ParamState, stage: int) -> None:
        """Move a parameter to ``stage`` and keep the busy count (lock held)."""
        if (state.stage == IDLE) != (stage == IDLE):
            self.busy += 1 if stage != IDLE else -1
        state.stage = stage

    def _check_accumulate(self, state: ParamState) -> None:
        with self._cond:
            self._latch.raise_if_set()
            if state.stage == IDLE:
                return
            if state.step_number > self._steps_called:
                raise GradientError(AGAIN.format(state.name))
            raise GradientError(
                f"parameter {state.name!r} got a gradient while its update from the last step was "
                "still pending; it was used without going through a module forward or a torch "
                "operation on this thread (call optimizer.synchronize() before such use)"
            )

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        state = self.states[id(param)]
        if state.sparse:
            return  # averaged at step()
        if self.plain:
            if not self._switch.route.gradient(state):
                raise GradientError(AGAIN.format(state.name))
            return
        with self._cond:
            state.passes += 1
            if state.passes < self.backward_passes_per_step:
                return
            self._round_open = True
        self._submit(state)

    def _prepared_gradient(self, state: ParamState) -> Optional[torch.Tensor]:
        """The parameter's gradient, checked, contiguous and (``prescale``) divided by the world size."""
        param = state.param
        with self._cond:
            state.passes = 0
        with suspended():
            grad = param.grad
            if grad is None:
                return None
            if grad.is_sparse:
                raise GradientError(undeclared_sparse(state.name))
            if not grad.is_contiguous():
                grad = grad.contiguous()
                param.grad = grad
            if self.prescale:
                grad.div_(self.world_size)
        return grad

    def _submit(self, state: ParamState) -> None:
        grad = self._prepared_gradient(state)
        if grad is None:
            return
        with self._cond:
            self.queue_gradient(state, grad, self._steps_called + 1)
        self.schedule(state)

    def queue_gradient(self, state: ParamState, grad: torch.Tensor, step: int) -> None:
        """Make ``state`` QUEUED for ``step`` with ``grad`` as its task's payload (lock held)."""
        ready = None
        if grad.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(grad.device))
        state.task = Task(
            key=state.key, numel=grad.numel(), itemsize=grad.element_size(), priority=state.priority,
            payload=grad.view(-1), fuse_key=(grad.dtype, grad.device), name=state.name, context=ready,
        )
        # The round this gradient belongs to (the same count on every rank): rank 0 launches
        # a round's gradients before any of the next (see core/policy.py).
        state.task.iteration = self.rounds + 1
        state.grad = grad
        state.version = grad._version
        state.discard = False
        state.step_number = step
        self._set_stage(state, QUEUED)

    def schedule(self, state: ParamState) -> None:
        """Submit ``state``'s queued task; its update follows once it is communicated."""
        future = self.scheduler.submit(state.task)
        future.add_done_callback(lambda done, state=state: self._on_communicated(state, done))

    def drop_gradients(self, states: List[ParamState]) -> None:
        """``states`` were queued with zeros that no rank needs (:mod:`.unused`): back to IDLE
        with no gradient and no update."""
        with self._cond:
            with suspended():
                for state in states:
                    if state.param.grad is state.grad:
                        state.param.grad = None
            for state in states:
                state.grad = None
                state.task = None
                state.zero_request = None
                if state.step_number <= self._steps_called:  # counted among its step's updates
                    self._updates.snapshots.take(state.step_number, state.group)
                self._set_stage(state, IDLE)
            self._cond.notify_all()

    def _on_communicated(self, state: ParamState, done) -> None:
        error = done.exception()
        with self._cond:
            if error is None and state.grad._version != state.version + state.task.writes:
                error = GradientError(
                    f"the gradient of {state.name!r} was modified in place while it was being "
                    "communicated; read or change gradients only after optimizer.synchronize() (reading "
                    "p.grad on the training thread waits by itself)"
                )
            if error is not None:
                self._fail_locked(error)
                return
            state.task = None  # done with it (the scheduler has released its payload)
            if state.discard:
                self._set_stage(state, IDLE)
            else:
                self._set_stage(state, COMMUNICATED)
                self._updates.ready.append(state)
            self._cond.notify_all()

    # ------------------------------------------------------------------ step

    def step(self) -> None:
        """Record this step's hyperparameters; updates follow as gradients arrive."""
        self._latch.raise_if_set()
        if self._on_step is not None:
            self._on_step()
        if self.compute_timeline is not None:
            self.compute_timeline.step_called()
        if self._closed:
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
            step = self._steps_called = self._steps_called + 1
            users = sum(1 for s in self.states.values() if s.stage != IDLE and s.step_number == step)
            self._updates.snapshots.record(step, self._optimizer.param_groups, users)
            self._cond.notify_all()
        # Backward is over: nothing more will come to merge with what is queued.
        self.scheduler.end_burst()
        self.scheduler.step_boundary()
        if self._switch is not None:
            self._switch.end_step(self)

    def finish_backward(self, shadow: bool = False) -> None:
        """The coming step's backward passes are over (``step()``, or the training thread
        reads a gradient in flight or calls ``synchronize()`` after backward): gradients not
        communicated during backward (partial accumulation, parameters that kept a gradient
        but were unused this iteration) go now, in key order on every rank, and parameters
        without one contribute zeros (:mod:`.unused`). Once per step (again after a
        ``zero_grad()`` dropped the step's gradients).

        ``shadow``: a rank out of data (:mod:`.join`) takes part in the others' round with
        zeros for every parameter, whose averages it then drops (it updates nothing)."""
        step = self._steps_called + 1
        if self._finished_step == step and not shadow:
            return
        if not shadow and self.round_notice is not None:
            self.round_notice()
        self._finished_step = step
        self._round_open = False
        late = [s for s in self.states.values()
                if not s.sparse and not (s.stage != IDLE and s.step_number == step)]
        dense = sum(1 for s in self.states.values() if not s.sparse)
        if self._switch is not None and 0 < len(late) < dense:
            self._switch.irregular = True  # a backward ran, without some parameters
        absent = []
        for state in late:
            if state.stage != IDLE:
                self.wait_readable(state)  # unused since its last step's update, still pending
            with suspended():
                kept = state.param.grad is not None and not shadow
            if kept:
                self._submit(state)
            elif self._absence is not None:
                absent.append(state)
        with self._cond:
            round_ = self.rounds + 1
            if self._absence is not None:
                self._absence.begin(round_, step, absent, shadow)
            if shadow:
                for state in absent:
                    state.discard = True
            self.rounds = round_
        if self._absence is not None:
            self._absence.send(round_, absent)

    def end_plain_round(self) -> None:
        """A round on the plain path (its ``step()``): counted, and told to a join context."""
        if self.round_notice is not None:
            self.round_notice()
        self.rounds += 1

    @property
    def steps_taken(self) -> int:
        """The steps this rank took part in: ``step()`` calls and shadow rounds (the same
        count on every rank between steps)."""
        return self._steps_called + self.shadowed

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
                self._wait_locked(lambda: all(s.stage == IDLE for s in self.states.values()), "the others' round")
            self.zero_grad(set_to_none=True)
            if self._switch is not None:
                self._switch.irregular = True
                self._switch.end_step(self)

    def _backward_unfinished(self) -> bool:
        """A backward of the coming step communicated something and was not finished yet."""
        return (self._round_open and self._finished_step != self._steps_called + 1
                and torch._C._current_graph_task_id() == -1)  # not from a hook inside backward

    def average_sparse(self, apply: bool) -> None:
        """Average the sparse gradients now (every rank at the same step); with ``apply``,
        update those parameters too, with this step's hyperparameters."""
        with suspended():
            self._sparse.step(self.states.values(), self._optimizer.param_groups, apply)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients now, or right after a pending update (which still needs them)."""
        with self._cond:
            discarded = []
            for state in self.states.values():
                if state.stage == IDLE:
                    continue
                if state.step_number > self._steps_called:
                    # Communicated for a step that will not come: drop the update.
                    state.discard = True
                    discarded.append(state)
                else:
                    state.zero_request = set_to_none
            self._updates.ready = [s for s in self._updates.ready if not s.discard]
            for state in discarded:
                if state.stage == COMMUNICATED:
                    self._set_stage(state, IDLE)
            if discarded:
                self._finished_step = 0  # the next backward of this step is a round of its own
            self._wait_locked(lambda: all(s.stage == IDLE for s in discarded), "discarded gradients")
            zero_now = [s for s in self.states.values() if s.stage == IDLE]
        with suspended():
            for state in zero_now:
                zero_gradient(state.param, set_to_none)

    def synchronize(self) -> None:
        """Wait for every gradient in flight and every update of the steps called so far
        (after a backward: its gradients, zeros for those it did not produce included)."""
        if not self.plain and self._backward_unfinished():
            self.finish_backward()
        with self._cond:
            self._wait_locked(
                lambda: all(s.stage == IDLE or (s.stage == COMMUNICATED and s.step_number > self._steps_called)
                            for s in self.states.values()),
                "pending updates",
            )

    # ------------------------------------------------------------------ waiting

    def wait_if_pending(self, tensor: torch.Tensor, gradient_only: bool) -> None:
        """Block while ``tensor`` is one of our parameters with a pending update (the read guard)."""
        state = self.states.get(id(tensor))
        if state is None:
            return
        if gradient_only and self._backward_unfinished():
            self.finish_backward()  # every gradient is read averaged, as after DDP's backward
        if state.stage != IDLE:
            self.wait_readable(state, gradient_only)

    def wait_readable(self, state: ParamState, gradient_only: bool = False) -> None:
        """Block until ``state``'s parameter may be read on the training thread."""
        with self._cond:
            self._wait_locked(lambda: self._readable(state, gradient_only), state.name)

    def _readable(self, state: ParamState, gradient_only: bool) -> bool:
        if state.stage == IDLE:
            return True
        if state.step_number > self._steps_called:
            # Step not called yet: the weights are current; a gradient is readable once averaged.
            return not gradient_only or state.stage == COMMUNICATED
        return False

    def hook_for_schedule(self, on: bool) -> None:
        """Hook (or unhook) what only the scheduled path needs on the training thread: the
        pre-accumulation check of each parameter and the modules' forward pre-hooks. On the
        plain path every update is done when ``step()`` returns, so neither has anything to
        do, and a module with no hook at all runs torch's fast call path (on a small model,
        a Python call per module and per parameter is measurable)."""
        self._params.check_accumulation(on)
        self._unhook_modules()
        if on:
            self._hook_modules()

    def _unhook_modules(self) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()

    def _hook_modules(self) -> None:
        """Each module that owns parameters waits for their pending updates before its forward
        (prepended: before any forward pre-hook of the user's, which may read them)."""
        for module in self._model.modules():
            own = [self.states[id(p)] for p in module.parameters(recurse=False) if id(p) in self.states]
            if own:
                self._module_hooks.append(module.register_forward_pre_hook(self._make_pre_hook(own), prepend=True))

    def _make_pre_hook(self, own: List[ParamState]):
        def wait_for_own_parameters(module, inputs):
            if self.busy:
                for state in own:
                    if state.stage != IDLE:
                        self.wait_readable(state)
        return wait_for_own_parameters

    def _wait_locked(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        if not done():
            # The training thread needs this now (e.g. a gradient read for clipping, or
            # synchronize() before step()): what is queued must not sit out a merge cycle
            # (cycle_ms) waiting for more gradients to come.
            self.scheduler.end_burst()
        while not done():
            self._latch.raise_if_set()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.scheduler.check()
                raise CommunicationTimeout(
                    f"waited {self.timeout} s for {what}; a peer may have died or stopped calling step()"
                )
            self._cond.wait(min(remaining, _WAIT_SLICE))
            if not self._latch:
                try:
                    self.scheduler.check()
                except BaseException as error:  # noqa: BLE001
                    self._fail_locked(error)
        self._latch.raise_if_set()

    # ------------------------------------------------------------------ updates

    def _applied(self, batch: List[ParamState]) -> None:
        """The updater applied ``batch``: deferred zero_grad, then the parameters are IDLE."""
        with self._cond:
            for state in batch:
                if state.zero_request is not None:
                    zero_gradient(state.param, state.zero_request)
                    state.zero_request = None
                state.grad = None
                self._set_stage(state, IDLE)
            self._cond.notify_all()

    # ------------------------------------------------------------------ errors and shutdown

    def _fail_locked(self, error: BaseException) -> None:
        if self._latch.set(error):
            logger.error("scheduled optimizer failed: %s", error)
        self._cond.notify_all()

    def close(self, wait: bool = True) -> None:
        """Finish (``wait=True``) or abandon pending work, stop threads and remove hooks."""
        with self._cond:
            if self._closed:
                return
        try:
            if self._switch is not None:
                self._switch.close()
            if wait and not self._latch:
                self.synchronize()
        finally:
            with self._cond:
                self._closed = True
                for state in self.states.values():
                    self._set_stage(state, IDLE)
                self._cond.notify_all()
            self._updates.join(timeout=30)
            self._params.remove()  # the parameters' hooks and checks
            self._unhook_modules()
            ReadGuard.detach(self)
            try:
                self.scheduler.stop(wait=wait and not self._latch)
            finally:
                if self._on_close is not None:
                    self._on_close()
