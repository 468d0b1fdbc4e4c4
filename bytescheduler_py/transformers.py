"""Hugging Face ``transformers``: ``bytescheduler.transformers.schedule(trainer)``.

>>> from bytescheduler.transformers import schedule                            # doctest: +SKIP
>>> trainer = schedule(transformers.Trainer(model=model, args=args, train_dataset=data))  # doctest: +SKIP
>>> trainer.train()                                                            # doctest: +SKIP

:func:`schedule` makes a ``Trainer`` (or any subclass of it) average its gradients through
bytescheduler's DDP communication hook, :func:`~bytescheduler.pytorch.scheduled_allreduce_hook`:
the Trainer still wraps the model in DDP through Accelerate, with the DDP options of its
``TrainingArguments`` (``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``,
``ddp_broadcast_buffers``, ``ddp_static_graph``), and its loop, accumulation, clipping,
LR schedule and checkpoints are unchanged. A :class:`ScheduledCallback` added to the
Trainer closes the scheduler at the end of each ``train()`` and warns, at the end of the
first step, if the hook did not run.

ScheduledOptimizer (the cross-iteration overlap) is not offered here: the Trainer zeroes the
gradients and accumulates them itself, outside the optimizer. Use
:func:`bytescheduler.accelerate.prepare` in an Accelerate loop for it.
Only this module imports ``transformers``; ``import bytescheduler`` does not.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, List, Optional

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bytescheduler.transformers needs Hugging Face transformers (pip install transformers)") from error

from .accelerate import HookSlot, SchedulingDDPKwargs, check_accelerator, check_options
from .core import SchedulerConfig
from .pytorch.session import close_all

__all__ = ["ScheduledCallback", "schedule"]

log = logging.getLogger("bytescheduler")


def schedule(trainer: "transformers.Trainer", *, config: Optional[SchedulerConfig] = None,
             **options: Any) -> "transformers.Trainer":
    """Make ``trainer`` average its gradients through bytescheduler; returns ``trainer``.

    Call it after building the Trainer and before ``train()``. ``config`` and ``**options``
    are the scheduler's (``partition_bytes=``, ``credit_bytes=``, ``timeline=``, ...; see
    :class:`~bytescheduler.SchedulerConfig`); DDP's options stay the ``TrainingArguments``'.
    A wrong option, or a Trainer that shards the model (FSDP, DeepSpeed), is refused here.
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"schedule() takes a transformers.Trainer, not {type(trainer).__name__}")
    check_options(options)
    SchedulerConfig.build(config, **options)
    if any(isinstance(c, ScheduledCallback) for c in trainer.callback_handler.callbacks):
        raise ValueError("this Trainer is already scheduled by bytescheduler: call schedule() once")
    callback = ScheduledCallback(trainer, config, options)
    trainer.add_callback(callback)
    callback.install()
    create = trainer.create_accelerator_and_postprocess

    def create_and_schedule() -> None:  # the Trainer makes a new Accelerator for a new batch size or trial
        create()
        callback.install()

    trainer.create_accelerator_and_postprocess = create_and_schedule
    return trainer


class ScheduledCallback(TrainerCallback):
    """What :func:`schedule` adds to the Trainer: keeps the hook's state for each ``train()``.

    At the start of ``train()`` a state closed by an earlier ``train()`` of the same DDP is
    renewed; at the end of the first step it warns if no gradient bucket reached the hook
    (the Trainer averaged without bytescheduler); at the end of ``train()`` the scheduler is
    closed on every rank.
    """

    def __init__(self, trainer: "transformers.Trainer", config: Optional[SchedulerConfig], options: dict) -> None:
        self._trainer = trainer
        self._config, self._options = config, dict(options)
        self._closers: List[Callable[..., None]] = []
        self.slots: List[HookSlot] = []  # one per DDP the Trainer made
        self._checked = False

    def install(self) -> None:
        """Put the scheduling DDP handler on the Trainer's (current) Accelerator."""
        accelerator = self._trainer.accelerator
        if not check_accelerator(accelerator):
            log.info("bytescheduler.transformers: a single process, nothing to schedule")
            return
        if not isinstance(accelerator.ddp_handler, SchedulingDDPKwargs):
            accelerator.ddp_handler = SchedulingDDPKwargs.like(
                accelerator.ddp_handler, self._config, self._options, self._closers, on_state=self.slots.append)

    def on_train_begin(self, args, state, control, **kwargs):
        for slot in self.slots:  # a DDP kept from an earlier train(): its hook's next state
            if slot.state.closed:
                slot.renew()
                self._closers.append(slot.close)
        self._checked = False

    def on_step_end(self, args, state, control, **kwargs):
        if self._checked:
            return
        self._checked = True
        if not check_accelerator(self._trainer.accelerator):
            return
        if not any(slot.state.iterations for slot in self.slots):
            warnings.warn(
                "bytescheduler.transformers: the Trainer's first step ran without the scheduled DDP hook "
                "(DDP, or whatever wraps the model, averaged without bytescheduler): the model was "
                "wrapped before schedule(trainer) was called, or not by the Trainer's Accelerator. "
                "Call schedule(trainer) right after building the Trainer, before train()", stacklevel=2)

    def on_train_end(self, args, state, control, **kwargs):
        pending, self._closers[:] = list(self._closers), []
        close_all(pending, wait=True)
