"""PyTorch Lightning: ``Trainer(strategy=ScheduledStrategy())``.

>>> from bytescheduler.lightning import ScheduledStrategy                      # doctest: +SKIP
>>> trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=2,          # doctest: +SKIP
...                                     strategy=ScheduledStrategy())
>>> trainer.fit(model)                                                         # doctest: +SKIP

:class:`ScheduledStrategy` is Lightning's ``DDPStrategy`` (the same launch, process group,
samplers, collectives and checkpoints) with one of bytescheduler's two PyTorch adapters in
place of DDP's own communication:

- ``adapter="optimizer"`` (the default): no DDP wrapper; every optimizer from
  ``configure_optimizers`` is wrapped in a :func:`~bytescheduler.pytorch.ScheduledOptimizer`,
  which averages the gradients itself and overlaps them with the next forward;
- ``adapter="hook"``: DDP with :func:`~bytescheduler.pytorch.scheduled_allreduce_hook`,
  registered on every device (Lightning's own ``ddp_comm_hook`` is registered on CUDA only).

The scheduler is built when Lightning sets the strategy up for ``fit`` (after it has
created the process group) and closed when Lightning tears it down, on every rank.
Only this module imports Lightning; ``import bytescheduler`` and
``import bytescheduler.pytorch`` do not.
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "bytescheduler.lightning needs PyTorch Lightning 2.x, imported as `lightning` "
        "(pip install lightning)") from error

from .core import ByteSchedulerError, SchedulerConfig
from .core.config import OPTION_NAMES
from .pytorch import ScheduledHookState, ScheduledOptimizer, scheduled_allreduce_hook
from .pytorch.session import close_all

__all__ = ["ADAPTERS", "ScheduledStrategy"]

log = logging.getLogger("bytescheduler")

ADAPTERS = ("optimizer", "hook")

SCHEDULER_OPTIONS = OPTION_NAMES  # the keywords every adapter takes

# What DistributedDataParallel takes besides the module and its devices (adapter="hook").
# Not its group: the scheduler averages over the whole world, as DDPStrategy's DDP does.
_DDP_OPTIONS = frozenset(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters) - {
    "self", "module", "device_ids", "output_device", "process_group", "device_mesh"}

# DDPStrategy's own hook options: ScheduledStrategy's hook is bytescheduler's.
_HOOK_OPTIONS = frozenset({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"})

# DDP's options that mean something without DDP (adapter="optimizer"): ScheduledOptimizer
# averages zeros for a parameter some rank did not use, whatever this says.
_NO_DDP_OPTIONS = frozenset({"find_unused_parameters"})


class ScheduledStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with bytescheduler's communication (see the module docstring).

    Args:
        adapter: ``"optimizer"`` (ScheduledOptimizer, no DDP wrapper: the speed-up) or
            ``"hook"`` (DDP with the scheduled communication hook).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, start_method: as ``DDPStrategy``'s (``gloo`` on CPU, ``nccl``
            on CUDA by default).
        process_group_timeout: ``DDPStrategy``'s ``timeout`` (a ``timedelta``), renamed:
            ``timeout`` is the scheduler's, in seconds, as with every adapter.
        backward_passes_per_step: ScheduledOptimizer's (adapter ``"optimizer"``); default:
            the Trainer's ``accumulate_grad_batches`` (the largest value of a
            ``GradientAccumulationScheduler``). Set it yourself under manual optimization.
        broadcast_buffers: as DDP's (and its default): rank 0's buffers are copied to every
            rank before each training forward.
        config: one :class:`~bytescheduler.SchedulerConfig` for all the options at once.
        **options: every ``SchedulerConfig`` option by name (``partition_bytes=``,
            ``credit_bytes=``, ``timeline=``, ``timeout=``, ``adaptive=``, ...); with
            ``adapter="hook"`` also DDP's own keywords (``find_unused_parameters=``,
            ``bucket_cap_mb=``, ``gradient_as_bucket_view=``, ``static_graph=``, ...).
    """

    def __init__(
        self,
        adapter: str = "optimizer",
        *,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        process_group_timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        backward_passes_per_step: Optional[int] = None,
        broadcast_buffers: bool = True,
        config: Optional[SchedulerConfig] = None,
        **options: Any,
    ) -> None:
        scheduler_options, ddp_options = _split_options(adapter, options)
        if backward_passes_per_step is not None and adapter != "optimizer":
            raise TypeError("backward_passes_per_step is ScheduledOptimizer's (adapter='optimizer'); "
                            "with adapter='hook' DDP accumulates under Lightning's no_sync as usual")
        # Refused here, on the rank that gave them, before any process group exists.
        SchedulerConfig.build(config, **scheduler_options)
        if adapter == "hook" and not broadcast_buffers:
            ddp_options["broadcast_buffers"] = False  # DDP's default otherwise (torch 2.13 warns at True)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout,
            start_method=start_method,
            **ddp_options,
        )
        self.adapter = adapter
        self._config = config
        self._options = scheduler_options
        self._backward_passes_per_step = backward_passes_per_step
        self._broadcast_buffers = broadcast_buffers
        self._scheduled: List[torch.optim.Optimizer] = []  # this fit's ScheduledOptimizers
        self.hook_state: Optional[ScheduledHookState] = None  # this fit's hook state
        self._passes_per_step = 1
        self._failed: Optional[BaseException] = None  # what interrupted this fit

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register no names (``DDPStrategy``'s ``"ddp"`` and its aliases stay DDP's)."""

    # ---------------------------------------------------------------- set-up (fit only)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP with the scheduled hook (``"hook"``), or leave it plain (``"optimizer"``)."""
        if self.adapter == "optimizer":
            # No DDP: ScheduledOptimizer averages the gradients itself. Lightning still calls
            # the steps through a wrapper's forward, as through DDP's (see _Steps).
            self.model = _Steps(self.lightning_module)
            return
        super().configure_ddp()  # DDP, and Lightning's ddp_comm_hook, which is None here
        self.hook_state = ScheduledHookState(model=self.lightning_module, config=self._config, **self._options)
        self.model.register_comm_hook(self.hook_state, scheduled_allreduce_hook)

    def setup(self, trainer: "pl.Trainer") -> None:
        self._failed = None
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.adapter == "optimizer":
            self._wrap_optimizers(trainer)

    def _wrap_optimizers(self, trainer: "pl.Trainer") -> None:
        """Replace each optimizer by its ScheduledOptimizer, everywhere Lightning refers to it."""
        passes = self._passes_per_step = self._backward_passes_per_step or _accumulation(trainer)
        wrapped: List[torch.optim.Optimizer] = []
        try:
            for index, optimizer in enumerate(self.optimizers):
                if isinstance(optimizer, LightningOptimizer):
                    optimizer = optimizer.optimizer
                if not any(group["params"] for group in optimizer.param_groups):
                    wrapped.append(optimizer)  # nothing to average (configure_optimizers returned None)
                    continue
                if isinstance(optimizer, torch.optim.LBFGS):
                    raise ValueError("ScheduledStrategy(adapter='optimizer') cannot run LBFGS: its step "
                                     "re-evaluates the model several times; use adapter='hook' or DDPStrategy")
                scheduled = ScheduledOptimizer(
                    self.model, optimizer, backward_passes_per_step=passes,
                    broadcast_buffers=self._broadcast_buffers and index == 0,  # once per step is enough
                    config=self._config, **self._options)
                _accept_closure(scheduled)
                self._scheduled.append(scheduled)
                for scheduler_config in self.lr_scheduler_configs:
                    if getattr(scheduler_config.scheduler, "optimizer", None) is optimizer:
                        scheduler_config.scheduler.optimizer = scheduled
                wrapped.append(scheduled)
        except BaseException:
            self._close(wait=False)
            raise
        self.optimizers = wrapped  # Lightning's LightningOptimizers are rebuilt around them

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        passes = self._passes_per_step
        if self._scheduled and passes > 1 and trainer.gradient_clip_val \
                and trainer.num_training_batches % passes != 0:
            # ScheduledOptimizer averages the gradients of a step after fewer than
            # backward_passes_per_step passes at step(), after the clipping has read them.
            rank_zero_warn(
                f"ScheduledStrategy: an epoch of {trainer.num_training_batches} batches ends with a step after "
                f"fewer than accumulate_grad_batches={passes} batches; with gradient clipping that step clips "
                "each rank's own gradients before they are averaged (DDP clips the averages). Make the epoch "
                "a multiple of accumulate_grad_batches, or use ScheduledStrategy(adapter='hook')")

    # ---------------------------------------------------------------- the end

    def on_exception(self, exception: BaseException) -> None:
        # Lightning tears the strategy down next. After an error of the training code on
        # every rank, the last step's updates are still finished (within the scheduler's
        # timeout), so the model is left as DDP would leave it; after a communication
        # failure, an interrupt or an error of the scheduler itself, pending work is dropped.
        self._failed = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the scheduler (every rank: Lightning tears down on each), then ``DDPStrategy``'s teardown."""
        failed, self._failed = self._failed, None
        try:
            if failed is None:
                self._close(wait=True)
            else:
                wait = not isinstance(failed, (ByteSchedulerError, torch.distributed.DistError, KeyboardInterrupt))
                try:
                    self._close(wait=wait)
                except Exception as error:  # noqa: BLE001 - Lightning re-raises the first error, not this
                    log.warning("ScheduledStrategy: closing the scheduler after %r failed too: %r", failed, error)
        finally:
            if isinstance(self.model, _Steps):
                self.model = self.lightning_module  # as DDPStrategy unwraps its DDP
            super().teardown()

    def _close(self, wait: bool) -> None:
        closers: List[Callable[..., None]] = [optimizer.close for optimizer in self._scheduled]
        if self.hook_state is not None:
            closers.append(self.hook_state.close)
        self._scheduled, self.hook_state = [], None
        close_all(closers, wait)


class _Steps(torch.nn.Module):
    """The model ScheduledOptimizer trains: the LightningModule, called as DDP calls it.

    Lightning runs ``training_step`` (and ``validation_step`` during fit) through the
    forward of the module that wraps the LightningModule (``DDPStrategy``'s DDP), so the
    wrapper's forward runs once per step, whatever the step calls inside. ScheduledOptimizer
    copies rank 0's buffers before the forward of the model it is given, where DDP copies
    them; given this wrapper, it does so at the same forwards as DDP, also when
    ``training_step`` calls a submodule rather than ``self(x)``.
    """

    def __init__(self, module: "pl.LightningModule") -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _split_options(adapter: str, options: Dict[str, Any]):
    """(the scheduler's options, DDP's) from the keywords, or a TypeError naming the fix."""
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter={adapter!r}: use 'optimizer' (ScheduledOptimizer, no DDP wrapper) "
                         "or 'hook' (DDP with the scheduled communication hook)")
    if isinstance(options.get("timeout"), timedelta):
        raise TypeError("timeout is the scheduler's, in seconds (SchedulerConfig.timeout); "
                        "the process group's timedelta is process_group_timeout=")
    if set(options) & _HOOK_OPTIONS:
        raise TypeError(f"{sorted(set(options) & _HOOK_OPTIONS)}: ScheduledStrategy communicates through "
                        "bytescheduler (adapter='hook' registers its scheduled hook itself); for another "
                        "comm hook use Lightning's DDPStrategy")
    scheduler = {k: v for k, v in options.items() if k in SCHEDULER_OPTIONS}
    ddp = {k: v for k, v in options.items() if k not in SCHEDULER_OPTIONS}
    allowed = _DDP_OPTIONS if adapter == "hook" else _NO_DDP_OPTIONS
    refused = sorted(set(ddp) - allowed)
    if refused:
        if adapter == "optimizer" and set(refused) <= _DDP_OPTIONS:
            raise TypeError(f"{refused}: DistributedDataParallel's option(s), and adapter='optimizer' uses no "
                            "DDP wrapper; use adapter='hook' to keep DDP")
        raise TypeError(f"unknown option(s) {refused}: ScheduledStrategy takes the scheduler's "
                        f"{sorted(SCHEDULER_OPTIONS)}" + (" and DDP's" if adapter == "hook" else ""))
    if adapter == "optimizer":
        ddp = {}  # find_unused_parameters: nothing to set, unused parameters are handled
    return scheduler, ddp


def _accumulation(trainer: "pl.Trainer") -> int:
    """The most backward passes Lightning accumulates before a step, in any epoch."""
    passes = [trainer.accumulate_grad_batches]
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler):
            passes.extend(callback.scheduling.values())
    return max(passes)


def _accept_closure(scheduled: torch.optim.Optimizer) -> None:
    """Let ``scheduled.step`` take Lightning's closure: run it first, then step.

    Lightning always steps with ``optimizer.step(closure=...)`` (its closure runs the
    training step, backward and gradient clipping); torch's own optimizers evaluate it once,
    first, then update, and so does this. ScheduledOptimizer refuses a closure because an
    optimizer that evaluates it more than once (LBFGS) cannot be scheduled; those are refused
    when the strategy wraps the optimizer.
    """
    base = type(scheduled)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._opt_called = True  # what torch's LR schedulers look for after a step
        base.step(self)
        return result

    # The LR schedulers of configure_optimizers were built on the unwrapped optimizer; this
    # mark tells them that this step is still one they may follow, so they do not warn.
    step._wrapped_by_lr_sched = True
    step.__doc__ = base.step.__doc__
    scheduled.__class__ = type(base.__name__, (base,), {"step": step, "__doc__": base.__doc__,
                                                        "__module__": base.__module__})
