"""ScheduledOptimizer: one line that overlaps gradient communication with the next forward.

>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)      # doctest: +SKIP
>>> optimizer = bytescheduler.pytorch.ScheduledOptimizer(model, optimizer)    # doctest: +SKIP
>>> for x, y in loader:                                                        # doctest: +SKIP
...     optimizer.zero_grad()
...     loss_fn(model(x), y).backward()
...     optimizer.step()
>>> optimizer.close()                                                          # doctest: +SKIP

No DDP wrapper: the model is plain; the returned optimizer is an instance of the user's
own optimizer class (``isinstance`` holds, LR schedulers, ``state_dict`` and
``load_state_dict`` work). See :mod:`bytescheduler.pytorch.overlap` for how it works.

When to call ``optimizer.synchronize()``: before reading or changing parameters or
gradients anywhere but on the training thread (another thread, ``p.data`` of a copy,
saving a model checkpoint from another process), at the end of training (``close()``
does it), and before evaluating on another thread. On the training thread every torch
operation that reads a parameter waits by itself; ``optimizer.state_dict()`` synchronizes.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

from ..core import SchedulerConfig
from ..core.timeline import check_writable
from .adaptive import PlainSetup
from .buffers import BufferSync
from .join import JoinSupport, join_methods
from .errors import check_arguments, refuse_wrapped
from .overlap import OverlapEngine
from .plain import FlatReducer, torch_agreement
from .layout import param_layout
from .session import TorchSession, agree_settings
from .sparse import gloo_all_reduce
from .unused import Absence

# A layer's gradients arrive milliseconds apart in backward; on a fast link each would go
# out alone, and an operation's fixed cost (Python, gloo's threads, the order message)
# is then most of its cost. Holding queued work up to 2 ms to merge it (until step()
# ends the burst) saves most of those costs on a fast link.
# Rank 0 times the scheduled path against the framework's own and keeps the faster
# (adaptive.py): where communication is hidden anyway, scheduling only costs CPU.
OPTIMIZER_DEFAULTS = SchedulerConfig(cycle_ms=2.0, adaptive=True)


class _ScheduledMethods:
    """Methods of the dynamic subclass; ``_bytescheduler`` is the engine, ``_bytescheduler_base`` the user's class."""

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """Start this step's updates; each lands as soon as its gradient is averaged.

        Returns at once (None). A ``closure`` is not supported: re-evaluating the model
        inside ``step`` would need every update first.
        """
        if closure is not None:
            raise ValueError(
                "ScheduledOptimizer.step() takes no closure: optimizers that re-evaluate the model "
                "(e.g. LBFGS) need every update at once; use the optimizer without bytescheduler"
            )
        self._opt_called = True  # what torch's LR schedulers look for after a step
        self._bytescheduler.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._bytescheduler.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Wait until every gradient in flight is averaged and every called step's update applied."""
        self._bytescheduler.synchronize()

    def state_dict(self):
        self._bytescheduler.synchronize()
        return self._bytescheduler_base.state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        self._bytescheduler.synchronize()
        self._bytescheduler_base.load_state_dict(self, state_dict)
        self._bytescheduler.refresh_state()

    def add_param_group(self, param_group) -> None:
        self._bytescheduler.synchronize()
        self._bytescheduler_base.add_param_group(self, param_group)
        self._bytescheduler.add_param_group(len(self.param_groups) - 1)

    def close(self, wait: bool = True) -> None:
        """Finish pending updates (``wait=True``), stop the scheduler and remove hooks; every rank calls it."""
        self._bytescheduler.close(wait=wait)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)


def wrap_optimizer(optimizer: torch.optim.Optimizer, base: type, engine_factory: Callable[[type], OverlapEngine],
                   extra: Optional[dict] = None):
    """Return an instance of a subclass of ``base`` that shares ``optimizer``'s attributes.

    The subclass is made at run time (as Horovod's DistributedOptimizer is), so
    ``isinstance(result, base)`` holds and everything the user's class defines keeps working.
    """
    methods = {k: v for k, v in vars(_ScheduledMethods).items() if not k.startswith("__") or k in ("__enter__", "__exit__")}
    methods["step"] = torch.optim.Optimizer.profile_hook_step(_ScheduledMethods.step)  # runs step hooks once per step
    # An LR scheduler made on the user's optimizer and pointed at this one (as Lightning and
    # Accelerate adapters do) sees a step it may follow: this step records that it ran.
    methods["step"]._wrapped_by_lr_sched = True
    methods["__doc__"] = base.__doc__
    methods.update(extra or {})
    cls = type(base.__name__, (base,), methods)
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # one set of param_groups, state and hooks
    wrapped.__dict__.pop("step", None)  # an instance-level patch of the old object's step
    wrapped._bytescheduler_base = base
    wrapped._bytescheduler = engine_factory(base)
    return wrapped


def ScheduledOptimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    process_group: Optional[dist.ProcessGroup] = None,
    backward_passes_per_step: int = 1,
    broadcast_parameters: bool = True,
    broadcast_buffers: bool = True,
    config: Optional[SchedulerConfig] = None,
    **options: Any,
):
    """Wrap ``optimizer`` so that communication overlaps the next forward (torch.distributed).

    Args:
        model: the plain model (no DDP wrapper) whose parameters ``optimizer`` trains.
        optimizer: any torch optimizer; its class, hyperparameters and state are kept.
        process_group: the group to average over (default: the whole world). Creating the
            optimizer is collective over the default group, like ``dist.new_group``.
        backward_passes_per_step: backward passes to accumulate locally before
            communicating (gradient accumulation); a step after fewer passes communicates
            what was accumulated.
        broadcast_parameters: copy rank 0's parameters and buffers to every rank first.
        broadcast_buffers: as DDP's option of that name (and its default): rank 0's buffers
            (BatchNorm's running statistics) are copied to every rank before each step's
            first training forward (:mod:`bytescheduler.pytorch.buffers`).
        config, **options: the scheduler's options (``partition_bytes=``, ``credit_bytes=``,
            ``cycle_ms=``, ...; see :class:`bytescheduler.core.SchedulerConfig`, the one place
            they are defined). Unset ones come from the environment or
            :data:`OPTIMIZER_DEFAULTS` (which holds work up to 2 ms to merge it, and with
            ``adaptive`` lets rank 0 run the plain, DDP-like path where that is faster).

    Returns an instance of ``type(optimizer)``. Call ``close()`` on every rank at the end.
    """
    def build():
        if isinstance(model, torch.nn.Module):
            refuse_wrapped(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if hasattr(optimizer, "_bytescheduler"):
            raise TypeError("this optimizer is already wrapped by bytescheduler: use it as it is "
                            "(wrapping it again would apply every update twice)")
        check_arguments(model, optimizer, backward_passes_per_step)
        settings = SchedulerConfig.build(config, defaults=OPTIMIZER_DEFAULTS, **options)
        check_writable(settings.timeline, dist.get_rank(process_group))
        return settings, param_layout(model)

    # Checked, then agreed with the other ranks: an error on one rank reaches every rank.
    agreed = agree_settings(process_group, build)
    if agreed is None:
        raise ValueError("this process is not a member of process_group; only members create a ScheduledOptimizer")

    def prepare(groups) -> None:
        if broadcast_parameters:
            _broadcast_from_first(model, process_group, groups.ranks[0])

    session = TorchSession(process_group, agreed, prepare)

    plain = None
    if agreed.adaptive and not agreed.auto_tune and session.world_size > 1:
        lane = session.groups.lanes[0]  # idle whenever the plain path or the agreement uses it
        plain = PlainSetup(FlatReducer(lane, session.world_size), torch_agreement(lane, session.groups.backend),
                           grad_views=agreed.grad_views, start_plain=agreed.start_plain,
                           mode_switch=agreed.mode_switch)

    buffers = None
    if broadcast_buffers and session.world_size > 1:
        buffers = BufferSync(model, session.groups.sparse, session.groups.ranks[0], backward_passes_per_step)

    join = None
    if session.world_size > 1:
        join = JoinSupport(model, session.groups.sparse, buffers is not None)

    def on_close() -> None:
        if buffers is not None:
            buffers.remove()
        if join is not None:
            join.remove()
        session.release()

    def engine(base: type) -> OverlapEngine:
        return OverlapEngine(
            model, optimizer, base, session.scheduler, session.world_size, prescale=True,
            backward_passes_per_step=backward_passes_per_step, timeout=agreed.timeout,
            on_close=on_close, plain=plain, sparse=gloo_all_reduce(session.groups.sparse),
            absence=Absence.DDP if session.world_size > 1 else None,
            on_step=None if buffers is None else buffers.step_called,
        )

    try:
        wrapped = wrap_optimizer(optimizer, type(optimizer), engine, join_methods(join))
    except BaseException:
        if buffers is not None:
            buffers.remove()
        if join is not None:
            join.remove()
        session.close(wait=False)
        raise
    if join is not None:
        wrapped._join_config = _JoinConfig.construct_disabled_join_config()
        join.joinable, join.engine = wrapped, wrapped._bytescheduler
        wrapped._bytescheduler.set_round_notice(join.notice)
    return wrapped


@torch.no_grad()
def _broadcast_from_first(model: torch.nn.Module, process_group, source: int) -> None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=source, group=process_group)
