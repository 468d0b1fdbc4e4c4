"""Horovod: the original ByteScheduler API, without patching Horovod.

>>> import horovod.torch as hvd                                                   # doctest: +SKIP
>>> import bytescheduler.pytorch.horovod as bsc                                   # doctest: +SKIP
>>> bsc.init()                                                                    # doctest: +SKIP
>>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # doctest: +SKIP
>>> optimizer = bsc.ScheduledOptimizer(model, optimizer, num_steps)               # doctest: +SKIP

Horovod moves the bytes (``allreduce_async_`` on each piece); bytescheduler decides which
pieces go when (priority, partition) and applies each parameter's update as soon
as its gradient is averaged. Horovod's coordinator already agrees on an order across
ranks, so no order channel is needed; merging is left to Horovod's tensor fusion (our
own merging would give different operations on different ranks).

No credit either: with every rank choosing by itself which pieces to hand to Horovod, a
credit deadlocks as soon as two ranks fill it with different pieces (each waits in
Horovod for the other to submit its own). Every ready piece is handed over at once, in
priority order, and Horovod's coordinator runs them as all ranks have them; the speed
comes from the cross-iteration overlap (the next forward waits only for its own layers).
"""

import itertools
import os
import queue
import threading
import time
import warnings
from typing import Any, List, Optional, Tuple

import horovod.torch as hvd
import torch

from ..core import Scheduler, SchedulerConfig
from ..core.config import Size
from ..core.scheduler import Done
from ..core.task import Operation
from .optimizer import wrap_optimizer
from .overlap import OverlapEngine

# A backward-pass countdown that never reaches zero keeps Horovod's own gradient hooks
# (registered on the autograd graph, impossible to remove) from communicating.
_NEVER = 1 << 62
# Bytes in flight under Horovod: unlimited (see the module docstring).
_NO_CREDIT = 1 << 62
# Creating a ScheduledOptimizer is collective, so backends are numbered alike on every rank:
# the number keeps the Horovod tensor names of two optimizers (e.g. a GAN's) apart.
_backend_ids = itertools.count()


def init() -> None:
    """Initialise Horovod if it is not yet (kept from the original API)."""
    if not hvd.is_initialized():
        hvd.init()


class HorovodBackend:
    """:class:`~bytescheduler.core.Backend` over ``hvd.allreduce_async_``.

    Completion is learned by one poller thread (Horovod offers ``poll``, not callbacks).
    """

    num_lanes = 1

    def __init__(self, op: Any = None) -> None:
        self._op = hvd.Average if op is None else op
        self.name = f"bytescheduler.{next(_backend_ids)}"
        self._incoming: "queue.SimpleQueue[Optional[Tuple[int, Done]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._poll, name="bytescheduler-horovod-poll", daemon=True)
        self._thread.start()

    def launch(self, op: Operation, done: Done) -> None:
        if len(op.pieces) != 1:
            raise ValueError("the Horovod backend takes one piece per operation (merge=False)")
        piece = op.pieces[0]
        view = piece.task.payload.narrow(0, piece.start, piece.stop - piece.start)
        handle = hvd.allreduce_async_(view, name=f"{self.name}.{piece.task.key}.{piece.start}", op=self._op)
        self._incoming.put((handle, done))

    def _poll(self) -> None:
        waiting: List[Tuple[int, Done]] = []
        pause = 1e-5
        while True:
            try:
                item = self._incoming.get(timeout=None if not waiting else 0)
                while True:
                    if item is None:
                        return
                    waiting.append(item)
                    item = self._incoming.get_nowait()
            except queue.Empty:
                pass
            still = []
            for handle, done in waiting:
                if not hvd.poll(handle):
                    still.append((handle, done))
                    continue
                try:
                    hvd.synchronize(handle)
                except BaseException as error:  # noqa: BLE001
                    done(error)
                    continue
                done(None)
            # Poll fast while operations finish, back off to 1 ms while they are slow.
            pause = 1e-5 if len(still) < len(waiting) else min(pause * 2, 1e-3)
            waiting = still
            if waiting:
                time.sleep(pause)

    def close(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=10)


def _unwrap(optimizer: torch.optim.Optimizer) -> Tuple[type, int]:
    """The user's optimizer class under Horovod's dynamic subclass, and its accumulation count."""
    if hasattr(optimizer, "_allreduce_delay") and hasattr(optimizer, "_allreduce_grad_async"):
        if getattr(optimizer, "_groups", None) is not None:
            raise ValueError("bytescheduler does not support hvd.DistributedOptimizer(groups=...): "
                             "it schedules each gradient itself; leave groups unset")
        compression = getattr(optimizer, "_compression", hvd.Compression.none)
        if compression is not hvd.Compression.none:
            raise ValueError("bytescheduler does not support Horovod compression; use hvd.Compression.none")
        if getattr(optimizer, "op", hvd.Average) is not hvd.Average:
            raise ValueError("bytescheduler averages gradients; hvd.DistributedOptimizer(op=...) must be hvd.Average")
        if getattr(optimizer, "gradient_predivide_factor", 1.0) != 1.0:
            raise ValueError("bytescheduler does not support gradient_predivide_factor; leave it at 1.0")
        process_set = getattr(optimizer, "process_set", hvd.global_process_set)
        if process_set is not hvd.global_process_set:
            raise ValueError("bytescheduler supports Horovod's global process set only")
        for param in optimizer._allreduce_delay:
            optimizer._allreduce_delay[param] = _NEVER
        optimizer._requires_update = set()
        return type(optimizer).__bases__[0], int(optimizer.backward_passes_per_step)
    return type(optimizer), 1


def ScheduledOptimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_steps: Optional[int] = None,
    partition_bytes: Optional[Size] = None,
    credit_bytes: Optional[Size] = None,
    timeout: Optional[float] = None,
    timeline: Optional[str] = None,
    backward_passes_per_step: Optional[int] = None,
    broadcast_parameters: bool = True,
    auto_tune: Optional[bool] = None,
):
    """Wrap ``hvd.DistributedOptimizer(optimizer)`` (or a plain optimizer) for scheduled overlap.

    Args:
        model: the model whose parameters the optimizer trains.
        optimizer: an ``hvd.DistributedOptimizer`` (its class, hyperparameters, state and
            ``backward_passes_per_step`` are kept) or a plain torch optimizer.
        num_steps: accepted for the original API and ignored: nothing needs to know when
            training ends (call ``close()``).
        partition_bytes, timeout, timeline, auto_tune: see
            :class:`bytescheduler.core.SchedulerConfig`. ``credit_bytes`` is refused (see
            the module docstring: it would deadlock). With ``auto_tune`` every rank
            uses rank 0's step times, so all ranks switch to the same sizes at the same step.
        backward_passes_per_step: defaults to the Horovod optimizer's.
        broadcast_parameters: copy rank 0's parameters and buffers to every rank first.

    Returns an instance of the user's optimizer class.
    """
    del num_steps
    if credit_bytes is not None:
        raise ValueError(
            "credit_bytes cannot be used with Horovod: each rank picks its own pieces, and a credit "
            "deadlocks when two ranks fill it with different ones; leave it unset (partition_bytes works)"
        )
    if hasattr(optimizer, "_bytescheduler"):
        raise TypeError("this optimizer is already wrapped by bytescheduler")
    if os.environ.get("BYTESCHEDULER_CREDIT"):
        warnings.warn("BYTESCHEDULER_CREDIT is ignored under Horovod: a credit would deadlock when ranks "
                      "pick different pieces (see bytescheduler.pytorch.horovod)", stacklevel=2)
    init()
    base, passes = _unwrap(optimizer)
    config = SchedulerConfig.resolve(
        partition_bytes=partition_bytes, timeout=timeout, timeline=timeline, merge=False, auto_tune=auto_tune,
    ).with_options(credit_bytes=_NO_CREDIT)
    if broadcast_parameters:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    backend = HorovodBackend()

    def agree(seconds: float) -> float:
        # Every rank partitions by itself here: all must see rank 0's measurement.
        return float(hvd.broadcast_object(seconds, root_rank=0, name=f"{backend.name}.tune"))

    scheduler = Scheduler(backend, channel=None, rank=hvd.rank(), config=config, tuning_agree=agree, tune_credit=False)

    def engine(base: type) -> OverlapEngine:
        return OverlapEngine(
            model, optimizer, base, scheduler, hvd.size(), prescale=False,
            backward_passes_per_step=backward_passes_per_step or passes, timeout=config.timeout,
            on_close=backend.close,
        )

    try:
        return wrap_optimizer(optimizer, base, engine)
    except BaseException:
        scheduler.stop(wait=False)
        backend.close()
        raise
