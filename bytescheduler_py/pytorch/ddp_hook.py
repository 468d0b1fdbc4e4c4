"""A DDP communication hook that schedules each bucket's all-reduce.

>>> state = ScheduledHookState()                                   # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, scheduled_allreduce_hook)   # doctest: +SKIP
>>> train()                                                         # doctest: +SKIP
>>> state.close()                                                   # doctest: +SKIP

Each bucket becomes one task: the core partitions it, merges small neighbours, keeps at
most ``credit_bytes`` in flight and lets a later, higher-priority bucket overtake the
remaining pieces of an earlier one. The result is the average, as with DDP's default hook
(each rank divides by the group size, then the pieces are summed).

With ``adaptive`` (the default) rank 0 also times iterations of the plain path, DDP's own
all-reduce of each whole bucket issued right in the hook, against the scheduled one and
runs the faster (:class:`~bytescheduler.core.modes.ModeDriver`; a first choice's ties go
to the plain path, a re-trial's to the held one). Both give the same numbers.
"""

import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import Scheduler, SchedulerConfig, Task
from ..core.errors import SchedulerClosed, as_library_error
from ..core.timeline import check_writable
from ..core.log import logger
from ..core.modes import PLAIN, ModeDriver, Phase, new_chooser
from ..core.startup import BUCKET_BYTES, StartupPredictor, StepSample
from .grad_views import BucketViews
from .plain import torch_agreement
from .layout import param_layout
from .session import TorchSession, agree_settings

# DDP ends an iteration only when every bucket is averaged, so no order within the
# iteration can shorten it; splitting buckets only adds operations (on loopback the
# 4 MiB default cost 4% against DDP, whole buckets 2%). The hook keeps buckets whole and
# in flight at once unless told otherwise; ScheduledOptimizer is where order pays. Even
# so the scheduler's threads cost CPU, so rank 0 also tries DDP's own path (adaptive).
HOOK_DEFAULTS = SchedulerConfig(partition_bytes=64 * 1024**2, credit_bytes=256 * 1024**2, adaptive=True)


class ScheduledHookState:
    """What :func:`scheduled_allreduce_hook` keeps between calls: the scheduler of one group.

    Args:
        process_group: the group to average over (default: the whole world). Creating the
            state is collective over the default group, like ``dist.new_group``: processes
            outside the group create one too, passing what ``dist.new_group`` returned to
            them; theirs is inert.
        model: optional; when given, a bucket's priority is the smallest position of its
            parameters in ``model.parameters()`` (forward order for most models). Without
            it, the bucket index is used in reverse: DDP numbers buckets in the order their
            gradients become ready in backward, which is reverse forward order.

    Call :meth:`close` (or use ``with``) on every rank when training ends. A state that saw
    no bucket by then (the hook was never registered, or a framework dropped it) warns.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        model: Optional[torch.nn.Module] = None,
        config: Optional[SchedulerConfig] = None,
        **options: Any,
    ) -> None:
        def build():
            if model is not None and not isinstance(model, torch.nn.Module):
                raise TypeError(f"model must be the torch.nn.Module DDP wraps (for priorities), or None, "
                                f"not {type(model).__name__}")
            settings = SchedulerConfig.build(config, defaults=HOOK_DEFAULTS, **options)
            check_writable(settings.timeline, dist.get_rank(process_group))
            return settings, None if model is None else param_layout(model)

        # Checked, then agreed with the other ranks: an error on one rank reaches every rank.
        agreed = agree_settings(process_group, build)  # None outside the group: an inert state
        settings = agreed if agreed is not None else SchedulerConfig.build(config, defaults=HOOK_DEFAULTS, **options)
        self._session = TorchSession(process_group, settings)
        self.scheduler: Optional[Scheduler] = self._session.scheduler
        self.world_size = self._session.world_size
        self.sparse_group = self._session.groups.sparse if self._session.groups is not None else None
        self.driver: Optional[ModeDriver] = None  # the mode switch (None: always scheduled)
        self._sampler: Optional[_BucketSampler] = None  # rank 0, the warm-up (start-up prediction)
        self.plain = False  # this iteration's buckets take DDP's own path
        self._iterations = 0
        self.closed = False
        if self.scheduler is not None and settings.adaptive and not settings.auto_tune and self.world_size > 1:
            self._lane = self._session.groups.lanes[0]  # idle whenever the plain path or the agreement uses it
            chooser = new_chooser(settings.mode_switch, settings.start_plain)
            leader = self._session.groups.rank == 0
            startup = None
            if chooser.params.predict and chooser.phase == Phase.WARMUP:
                # DDP's own path can be predicted (its buckets hide their communication); the
                # scheduled hook cannot end an iteration sooner than DDP by a wide margin.
                startup = StartupPredictor(_probe_on(self._lane, self._session.groups.backend),
                                           _model_bytes(model), leader, 0, 0, schedules=False,
                                           report=lambda prediction: logger.info("rank 0: %s", prediction.text()))
                self._sampler = _BucketSampler(startup) if leader else None
            self.driver = ModeDriver(chooser, leader, torch_agreement(self._lane, self._session.groups.backend),
                                     rank=self._session.groups.rank, startup=startup)
            self.plain = self.driver.mode == PLAIN  # a plan may start on DDP's own path
        # Each large gradient becomes a view of the buffer the bucket is averaged in, so DDP's
        # copy back is a no-op: that saves the pass this hook's division costs (DDP's
        # built-in path divides while it copies gradients into the bucket; a comm hook gets
        # the bucket undivided).
        self.views = BucketViews() if settings.grad_views else None
        self._positions: Optional[Dict[int, int]] = None
        if model is not None:
            self._positions = {id(p): i for i, p in enumerate(model.parameters())}

    def priority(self, bucket: dist.GradBucket) -> int:
        """Lower goes sooner: the bucket's earliest parameter in forward order."""
        if self._positions is not None:
            found = [self._positions[id(p)] for p in bucket.parameters() if id(p) in self._positions]
            if found:
                return min(found)
        return -bucket.index()

    @property
    def iterations(self) -> int:
        """How many iterations' buckets reached the hook (0: it never ran)."""
        return self._iterations

    def begin_iteration(self) -> None:
        """The first bucket of an iteration arrived: the last iteration ended (every bucket
        of it averaged, as DDP waits for them); let the mode switch see it."""
        if self._iterations and self.driver is not None:
            if self._sampler is not None:
                self._sampler.iteration_ended()
            self.plain = self.driver.end_step(drain=self.scheduler.flush) == PLAIN
            if self._sampler is not None and (self.plain or self.driver.chooser.phase != Phase.WARMUP):
                self._sampler = None
        self._iterations += 1
        if not self.plain:
            self.scheduler.step_boundary()

    def close(self, wait: bool = True) -> None:
        """Stop the scheduler; every rank of the group calls it.

        ``wait=True`` first finishes pending communication; ``wait=False`` abandons it
        (after an exception in the training loop). Closing twice does nothing.
        """
        if self.closed:
            return
        self.closed = True
        if wait and self._iterations == 0 and self.scheduler is not None:
            # The hook never ran: DDP averaged on its own, and nothing said so (a framework
            # that drops a comm hook it was given does not, e.g. Lightning off CUDA).
            warnings.warn(
                "ScheduledHookState saw no gradient bucket before close(): DDP averaged without "
                "bytescheduler. Register the hook on the DDP model, "
                "`ddp_model.register_comm_hook(state, scheduled_allreduce_hook)` (with PyTorch Lightning: "
                "`strategy=bytescheduler.lightning.ScheduledStrategy(adapter='hook')`; its DDPStrategy "
                "registers ddp_comm_hook on CUDA only)", UserWarning, stacklevel=2)
        self._session.close(wait=wait)

    def __enter__(self) -> "ScheduledHookState":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)


def scheduled_allreduce_hook(
    state: ScheduledHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` across the group through bytescheduler's priority queue.

    >>> ddp_model.register_comm_hook(ScheduledHookState(), scheduled_allreduce_hook)  # doctest: +SKIP
    """
    if state.scheduler is None:
        raise RuntimeError("this process is not a member of the hook state's process group")
    if state.closed:
        raise SchedulerClosed("the ScheduledHookState was closed: DDP cannot average through it any more; "
                              "register the hook with a new ScheduledHookState, or close after the last step")
    if bucket.index() == 0:  # the first bucket of an iteration: a step begins
        state.begin_iteration()
    buffer = bucket.buffer()
    sampler = state._sampler
    if sampler is not None:
        sampler.bucket(buffer)
    if state.views is not None and not buffer.is_sparse:
        buffer = state.views.divide(bucket, state.world_size)
    else:
        buffer.div_(state.world_size)
    if buffer.is_sparse or state.plain:  # what DDP's default hook does
        # A sparse bucket (nn.Embedding(sparse=True)) cannot be cut into pieces: it goes on a
        # gloo group of its own, in DDP's bucket order, the same on every rank.
        group = state.sparse_group if buffer.is_sparse else state._lane
        rank = state._session.groups.rank
        try:
            work = dist.all_reduce(buffer, group=group, async_op=True)
        except Exception as error:  # noqa: BLE001 - a peer died or the network failed: say so
            raise as_library_error(error, rank) from error
        return work.get_future().then(lambda future: _first_value(future, rank))
    ready = None
    if buffer.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(buffer.device))
        outcome: torch.futures.Future = torch.futures.Future(devices=[buffer.device])
    else:
        outcome = torch.futures.Future()
    task = Task(
        key=bucket.index(),
        numel=buffer.numel(),
        itemsize=buffer.element_size(),
        priority=state.priority(bucket),
        payload=buffer,
        fuse_key=(buffer.dtype, buffer.device),
        name=f"bucket{bucket.index()}",
        context=ready,
    )
    communicated = state.scheduler.submit(task)
    if bucket.is_last():  # nothing more comes this iteration: stop holding buckets to merge
        state.scheduler.end_burst()
    # DDP reads the future from C++, where only an error raised inside ``then`` counts as
    # an error (a Python-side set_exception would reach DDP as a value it cannot cast).
    if sampler is not None:
        communicated.add_done_callback(lambda done: sampler.completed())
    communicated.add_done_callback(lambda done: outcome.set_result(done.exception() or buffer))
    return outcome.then(_buffer_or_raise)


class _BucketSampler:
    """Rank 0's warm-up iterations after the first, for the start-up prediction: when each
    bucket reached the hook, and when the last one was averaged. An iteration's compute is
    the span of its buckets (backward) plus the time from the previous iteration's end to its
    first bucket (the update, the forward and the start of backward)."""

    def __init__(self, startup: StartupPredictor) -> None:
        self._startup = startup
        self._ready: List[Tuple[float, int]] = []
        self._done = 0.0
        self._previous_end: Optional[float] = None

    def bucket(self, buffer: torch.Tensor) -> None:
        self._ready.append((time.perf_counter(), buffer.numel() * buffer.element_size()))

    def completed(self) -> None:
        self._done = time.perf_counter()

    def iteration_ended(self) -> None:
        """The next iteration's first bucket came: every bucket of the last one is averaged."""
        ready, self._ready = self._ready, []
        if not ready:
            return
        first, last = ready[0][0], ready[-1][0]
        end = max(last, self._done)
        if self._previous_end is not None:
            self._startup.add(StepSample(first - self._previous_end, last - first,
                                         [(t - first, nbytes) for t, nbytes in ready], end - self._previous_end))
        self._previous_end = end


def _probe_on(group: Any, backend: str) -> Callable[[int, int], None]:
    """The start-up probe's all-reduce: DDP's own (one whole bucket on the lane)."""
    def all_reduce(key: int, nbytes: int) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        dist.all_reduce(torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device), group=group)

    return all_reduce


def _model_bytes(model: Optional[torch.nn.Module]) -> int:
    """The gradients' bytes (bounds the probe), or DDP's default bucket's without the model."""
    if model is None:
        return BUCKET_BYTES
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _first_value(future: torch.futures.Future, rank: int) -> torch.Tensor:
    try:
        return future.value()[0]
    except Exception as error:  # noqa: BLE001 - raised inside then(), which DDP reports as the error
        raise as_library_error(error, rank) from error


def _buffer_or_raise(future: torch.futures.Future) -> torch.Tensor:
    value = future.value()
    if isinstance(value, BaseException):
        raise value
    return value
