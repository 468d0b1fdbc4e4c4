"""Hugging Face Accelerate: ``bytescheduler.accelerate.prepare(accelerator, ...)``.

>>> import bytescheduler.accelerate as bsa                                      # doctest: +SKIP
>>> accelerator = accelerate.Accelerator()                                     # doctest: +SKIP
>>> model, optimizer, loader, scheduler = bsa.prepare(                         # doctest: +SKIP
...     accelerator, model, optimizer, loader, scheduler)

:func:`prepare` takes what ``accelerator.prepare`` takes and returns the same objects, in
the same order, prepared by Accelerate, with one of bytescheduler's two PyTorch adapters in
place of DDP's own communication:

- ``adapter="optimizer"`` (the default): Accelerate places the model and applies mixed
  precision, but does not wrap it in DDP; each optimizer becomes a
  :func:`~bytescheduler.pytorch.ScheduledOptimizer` (averaging the gradients itself and
  overlapping them with the next forward) inside Accelerate's ``AcceleratedOptimizer``;
- ``adapter="hook"``: Accelerate wraps the model in DDP as usual and
  :func:`~bytescheduler.pytorch.scheduled_allreduce_hook` is registered on it (Accelerate's
  ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own hooks).

The training loop stays Accelerate's: ``accelerator.backward``, ``accelerator.accumulate``,
``accelerator.clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
``accelerator.save_state``. Call :func:`close` (or ``accelerator.end_training()``, which
this module makes close the scheduler first) on every rank at the end.
Only this module imports Accelerate; ``import bytescheduler`` does not.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional

import torch

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType
    from accelerate.utils.dataclasses import DDPCommunicationHookType
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bytescheduler.accelerate needs Hugging Face Accelerate (pip install accelerate)") from error

from .core import SchedulerConfig
from .core.config import OPTION_NAMES as SCHEDULER_OPTIONS
from .pytorch import ScheduledHookState, ScheduledOptimizer, scheduled_allreduce_hook
from .pytorch.session import close_all

__all__ = ["ADAPTERS", "HookSlot", "SchedulingDDPKwargs", "close", "prepare"]

log = logging.getLogger("bytescheduler")

ADAPTERS = ("optimizer", "hook")

# What DDP-style data parallelism Accelerate runs these as (the others shard or replace the model).
_DATA_PARALLEL = frozenset(t for t in DistributedType if t.name.startswith("MULTI_"))

# Where this module keeps what it built on an Accelerator: the closers, in order.
_CLOSERS = "_bytescheduler_closers"


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    adapter: str = "optimizer",
    backward_passes_per_step: Optional[int] = None,
    broadcast_buffers: Optional[bool] = None,
    device_placement: Optional[List[bool]] = None,
    config: Optional[SchedulerConfig] = None,
    **options: Any,
) -> Any:
    """``accelerator.prepare(*objects)`` with bytescheduler's communication (see the module docstring).

    Args:
        accelerator: the ``accelerate.Accelerator`` of the script (DDP-style data
            parallelism: one process per device; FSDP, DeepSpeed, Megatron-LM, XLA and tensor
            or context parallelism are refused, naming the fix).
        objects: models, optimizers, data loaders and LR schedulers, as ``accelerator.prepare``
            takes them. With ``adapter="optimizer"`` each optimizer is given in the same call
            as the model whose parameters it trains.
        adapter: ``"optimizer"`` (ScheduledOptimizer, no DDP wrapper: the speed-up) or
            ``"hook"`` (DDP with the scheduled communication hook).
        backward_passes_per_step: ScheduledOptimizer's; default: the Accelerator's
            ``gradient_accumulation_steps``.
        broadcast_buffers: as DDP's; default: the Accelerator's DDP kwargs handler's
            (``True`` without one).
        device_placement: as ``accelerator.prepare``'s.
        config, **options: every ``SchedulerConfig`` option by name (``partition_bytes=``,
            ``credit_bytes=``, ``timeline=``, ``timeout=``, ...), or ``config=``.

    Returns what ``accelerator.prepare`` returns: the prepared objects in order (one object
    alone when one was given). In a single process (no distributed run) nothing is
    scheduled and this is ``accelerator.prepare``.
    """
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter={adapter!r}: use 'optimizer' (ScheduledOptimizer, no DDP wrapper) "
                         "or 'hook' (DDP with the scheduled communication hook)")
    check_options(options)
    if backward_passes_per_step is not None and adapter != "optimizer":
        raise TypeError("backward_passes_per_step is ScheduledOptimizer's (adapter='optimizer'); with "
                        "adapter='hook' DDP accumulates under accelerator.accumulate as usual")
    SchedulerConfig.build(config, **options)  # a wrong option is refused here, on this rank
    if device_placement is None:
        device_placement = [None] * len(objects)
    if len(device_placement) != len(objects):
        raise ValueError(f"device_placement has {len(device_placement)} entries for {len(objects)} objects")
    if not check_accelerator(accelerator):
        log.info("bytescheduler.accelerate.prepare: a single process, nothing to schedule")
        return accelerator.prepare(*objects, device_placement=device_placement)
    handler = accelerator.ddp_handler
    if broadcast_buffers is None:
        broadcast_buffers = handler.broadcast_buffers if handler is not None else True
    closers = _closers(accelerator)
    if adapter == "hook":
        hooking = SchedulingDDPKwargs.like(handler, config, options, closers)
        if not broadcast_buffers:
            hooking.broadcast_buffers = False
        accelerator.ddp_handler = hooking
        try:
            result = accelerator.prepare(*objects, device_placement=device_placement)
        finally:
            accelerator.ddp_handler = handler
        return result
    passes = backward_passes_per_step or accelerator.gradient_accumulation_steps
    return _prepare_scheduled(accelerator, list(objects), device_placement, passes, broadcast_buffers,
                              config, options, closers)


def close(accelerator: Accelerator, wait: bool = True) -> None:
    """Close every scheduler :func:`prepare` built on ``accelerator``; every rank calls it.

    ``wait=True`` first finishes pending updates; ``wait=False`` abandons them (after an
    error). ``accelerator.end_training()`` calls this first. Closing twice does nothing.
    """
    closers: List[Callable[..., None]] = getattr(accelerator, _CLOSERS, [])
    pending, closers[:] = list(closers), []
    close_all(pending, wait)


class SchedulingDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP kwargs handler that registers the scheduled hook on the DDP it makes.

    Accelerate calls ``ddp_handler.register_comm_hook(model)`` right after wrapping a model
    in DDP (its own handler maps only Accelerate's enum of hooks); this one registers
    :func:`scheduled_allreduce_hook` with a new :class:`ScheduledHookState`. Used by
    :func:`prepare` (``adapter="hook"``) and :func:`bytescheduler.transformers.schedule`,
    which set it as the Accelerator's ``ddp_handler``; its DDP keywords are the handler's
    it replaces.
    """

    _scheduling: Dict[str, Any]

    @classmethod
    def like(cls, handler: Optional[DistributedDataParallelKwargs], config: Optional[SchedulerConfig],
             options: Dict[str, Any], closers: List[Callable[..., None]],
             on_state: Optional[Callable[["HookSlot"], None]] = None) -> "SchedulingDDPKwargs":
        ddp = {} if handler is None else DistributedDataParallelKwargs.to_dict(handler)
        made = cls(**ddp)
        made._scheduling = {"config": config, "options": dict(options), "closers": closers, "on_state": on_state}
        return made

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")):
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items()
                if k not in ignore_keys and k != "_scheduling"}

    def register_comm_hook(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        scheduling = self._scheduling
        slot = HookSlot(model.module, scheduling["config"], scheduling["options"])
        scheduling["closers"].append(slot.close)
        model.register_comm_hook(slot, _slot_hook)
        if scheduling["on_state"] is not None:
            scheduling["on_state"](slot)


class HookSlot:
    """The state DDP holds for the scheduled hook: one :class:`ScheduledHookState` at a time.

    DDP takes a communication hook once, for its lifetime; a framework that trains the same
    DDP again after closing the scheduler (the ``transformers`` Trainer's second ``train()``)
    :meth:`renew` s the state in the slot instead.
    """

    def __init__(self, module: torch.nn.Module, config: Optional[SchedulerConfig], options: Dict[str, Any]) -> None:
        self._module, self._config, self._options = module, config, dict(options)
        self.state = ScheduledHookState(model=module, config=config, **self._options)

    def renew(self) -> None:
        """A new state if this one was closed (collective: every rank calls it)."""
        if self.state.closed:
            self.state = ScheduledHookState(model=self._module, config=self._config, **self._options)

    def close(self, wait: bool = True) -> None:
        self.state.close(wait=wait)


def _slot_hook(slot, bucket):  # no annotations: DDP checks them, and this module's are strings
    return scheduled_allreduce_hook(slot.state, bucket)


# ------------------------------------------------------------------------------ inside


def check_options(options: Dict[str, Any]) -> None:
    unknown = sorted(set(options) - SCHEDULER_OPTIONS)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}: bytescheduler takes the scheduler's "
                        f"{sorted(SCHEDULER_OPTIONS)} here; DDP's options stay where Accelerate takes them "
                        "(DistributedDataParallelKwargs, or the Trainer's TrainingArguments)")


def check_accelerator(accelerator: Accelerator) -> bool:
    """True where there is something to schedule; False in a single process; an error naming the fix else."""
    if accelerator.distributed_type == DistributedType.NO or accelerator.num_processes == 1:
        return False
    kind = accelerator.distributed_type
    parallelism = getattr(accelerator, "parallelism_config", None)
    sharded = parallelism is not None and any(
        getattr(parallelism, name, False) for name in ("tp_enabled", "cp_enabled", "fsdp_enabled", "sp_enabled"))
    if kind not in _DATA_PARALLEL or sharded:
        what = "tensor, context or sharded parallelism" if sharded else f"distributed_type={kind.value}"
        raise ValueError(f"bytescheduler schedules DDP-style data parallelism (one process per device, the "
                         f"whole model on each), not {what}: leave it to Accelerate there")
    handler = accelerator.ddp_handler
    if handler is not None and not isinstance(handler, SchedulingDDPKwargs) and (
            handler.comm_hook != DDPCommunicationHookType.NO or handler.comm_wrapper != DDPCommunicationHookType.NO):
        raise ValueError(f"the Accelerator's DistributedDataParallelKwargs sets comm_hook={handler.comm_hook.value!r} "
                         f"(comm_wrapper={handler.comm_wrapper.value!r}): bytescheduler registers its own hook; "
                         "leave comm_hook unset, or use Accelerate's hooks without bytescheduler")
    return True


def _closers(accelerator: Accelerator) -> List[Callable[..., None]]:
    """The closers kept on ``accelerator`` (and ``end_training`` made to run them first)."""
    closers = getattr(accelerator, _CLOSERS, None)
    if closers is None:
        closers = []
        setattr(accelerator, _CLOSERS, closers)
        end_training = accelerator.end_training

        def end_training_closing_first() -> None:
            close(accelerator)
            end_training()

        end_training_closing_first.__doc__ = end_training.__doc__
        accelerator.end_training = end_training_closing_first
    return closers


def _prepare_scheduled(accelerator: Accelerator, objects: List[Any], placement: List[Optional[bool]], passes: int,
                       broadcast_buffers: bool, config: Optional[SchedulerConfig], options: Dict[str, Any],
                       closers: List[Callable[..., None]]) -> Any:
    """adapter="optimizer": models placed without DDP, optimizers scheduled, the rest Accelerate's."""
    models = [i for i, obj in enumerate(objects) if isinstance(obj, torch.nn.Module)]
    optimizers = [i for i, obj in enumerate(objects) if isinstance(obj, torch.optim.Optimizer)]
    owner = _owners(objects, models, optimizers)
    result: List[Any] = list(objects)
    for i in models:
        model = objects[i]
        if getattr(model, "_is_accelerate_prepared", False):
            raise ValueError("this model was already prepared by Accelerate (wrapped in DDP, which averages "
                             "its gradients itself): give bytescheduler.accelerate.prepare the model before "
                             "accelerator.prepare")
        prepared = accelerator.prepare_model(model, device_placement=placement[i], evaluation_mode=True)
        prepared._is_accelerate_prepared = True  # a later accelerator.prepare(model) keeps it as it is
        result[i] = prepared
    scheduled: Dict[int, torch.optim.Optimizer] = {}  # id(original optimizer) -> its ScheduledOptimizer
    try:
        for count, i in enumerate(optimizers):
            optimizer = objects[i]
            wrapped = ScheduledOptimizer(
                result[owner[i]], optimizer, backward_passes_per_step=passes,
                broadcast_buffers=broadcast_buffers and count == 0,  # once per step is enough
                config=config, **options)
            closers.append(wrapped.close)
            scheduled[id(optimizer)] = wrapped
            result[i] = accelerator.prepare_optimizer(wrapped, device_placement=placement[i])
            result[i]._is_accelerate_prepared = True
    except BaseException:
        close(accelerator, wait=False)
        raise
    rest = [i for i in range(len(objects)) if i not in models and i not in optimizers]
    for i in rest:  # an LR scheduler follows the optimizer that now steps
        follows = getattr(objects[i], "optimizer", None)
        if isinstance(objects[i], torch.optim.lr_scheduler.LRScheduler) and id(follows) in scheduled:
            objects[i].optimizer = scheduled[id(follows)]
    if rest:
        prepared_rest = accelerator.prepare(*(objects[i] for i in rest),
                                            device_placement=[placement[i] for i in rest])
        if len(rest) == 1:
            prepared_rest = (prepared_rest,)
        for i, obj in zip(rest, prepared_rest):
            result[i] = obj
    return tuple(result) if len(result) != 1 else result[0]


def _owners(objects: List[Any], models: List[int], optimizers: List[int]) -> Dict[int, int]:
    """For each optimizer (by position), the position of the model whose parameters it trains."""
    owner: Dict[int, int] = {}
    for i in optimizers:
        params = {id(p) for group in objects[i].param_groups for p in group["params"]}
        holders = [m for m in models if params <= {id(p) for p in objects[m].parameters()}]
        if not holders:
            raise ValueError(f"the optimizer at position {i} trains parameters of no model given in this call: "
                             "give bytescheduler.accelerate.prepare each optimizer with its model (adapter="
                             "'optimizer' schedules an optimizer over the model it trains)")
        owner[i] = holders[0]
    trained = set(owner.values())
    for m in models:
        if m not in trained and any(p.requires_grad for p in objects[m].parameters()):
            raise ValueError(f"the model at position {m} has trainable parameters but no optimizer of this call "
                             "trains them: with adapter='optimizer' the optimizer averages the gradients, so give "
                             "it in the same call (or use adapter='hook', which keeps DDP)")
    return owner
