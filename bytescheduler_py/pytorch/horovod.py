"""Horovod: the original ByteScheduler API, without patching Horovod.

>>> import horovod.torch as hvd                                                   # doctest: +SKIP
>>> import bytescheduler.pytorch.horovod as bsc                                   # doctest: +SKIP
>>> bsc.init()                                                                    # doctest: +SKIP
>>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # doctest: +SKIP
>>> optimizer = bsc.ScheduledOptimizer(model, optimizer)                          # doctest: +SKIP

Horovod moves the bytes (``allreduce_async_`` on each piece); bytescheduler decides which
pieces go when (priority, partition, credit) and applies each parameter's update as soon
as its gradient is averaged. Merging is left to Horovod's tensor fusion.

Rank 0 decides, the other ranks follow: its decisions reach them over a TCP connection
from rank 0 (set up through Horovod's object broadcast and all-gather), or, where a rank
cannot reach rank 0 that way, by small Horovod broadcasts (:class:`HorovodOrderChannel`);
every rank hands exactly those pieces to Horovod. A decision as a Horovod broadcast is one
more operation for Horovod's single background thread to negotiate and run, in the same
queue as the gradients; over TCP it costs a socket write. Each rank choosing for itself would deadlock under a credit: gradients become
ready at slightly different moments on each rank, two ranks fill their credits with
different pieces, and each waits inside Horovod for the other to submit its own.
"""

import contextlib
import functools
import itertools
import math
import os
import queue
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from ..core import Scheduler, SchedulerConfig
from ..core.agreement import attempt, settle
from ..core.backend import Done
from ..core.call_thread import CallThread
from ..core.config import parse_bool
from ..core.errors import CommunicationTimeout, as_library_error
from ..core.modes import STOP
from ..core.ordering import read_frame
from ..core.tcp_channel import TcpOrderChannel, connect
from ..core.task import Operation
from ..core.timeline import check_writable
from .adaptive import PlainSetup
from .optimizer import wrap_optimizer
from .order import frame_tensors
from .layout import param_layout
from .errors import check_arguments
from .groups import require_numpy
from .horovod_hold import Held
from .horovod_join import JoinGuard, JoinUnsupported, ShadowJoin  # noqa: F401 - JoinUnsupported is public here
from .overlap import OverlapEngine
from .unused import Absence

# A backward-pass countdown that never reaches zero keeps Horovod's own gradient hooks
# (registered on the autograd graph, impossible to remove) from communicating.
_NEVER = 1 << 62
# Seconds a wait polls without sleeping (see _wait_for).
_SPIN_SECONDS = 0.05
# Horovod runs one operation at a time and negotiates each, so fewer, larger pieces pay off
# (8 MiB under a 16 MiB credit beat the library's 4/16 MiB at 1 and 2 Gbit/s; docs/benchmarks.md).
# Rank 0 also times this against Horovod's own path and keeps the faster (adaptive.py).
HOROVOD_DEFAULTS = SchedulerConfig(partition_bytes=8 * 1024**2, credit_bytes=16 * 1024**2, adaptive=True)
# int64 words per ordering broadcast (a decision of one piece takes 6 words).
_ORDER_WORDS = 128
# Ordering broadcasts reuse this many names, so that Horovod's response cache knows them.
_ORDER_NAMES = 256
# Creating a ScheduledOptimizer is collective, so backends are numbered alike on every rank:
# the number keeps the Horovod tensor names of two optimizers (e.g. a GAN's) apart.
_backend_ids = itertools.count()


_horovods_join = hvd.join
_join_guard = JoinGuard(_horovods_join)


def init() -> None:
    """Initialise Horovod if it is not yet (kept from the original API)."""
    if not hvd.is_initialized():
        hvd.init()


class HorovodBackend:
    """:class:`~bytescheduler.core.Backend` over ``hvd.allreduce_async_``.

    ``op`` and the scale factors are Horovod's, as ``hvd.DistributedOptimizer`` passes them
    (:func:`_reduction`); each piece is reduced with them, as the whole gradient would be.
    Completion is learned by one poller thread (Horovod offers ``poll``, not callbacks).
    """

    num_lanes = 1

    def __init__(self, op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None:
        self._op = hvd.Average if op is None else op
        self._factors = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
        self.name = f"bytescheduler.{next(_backend_ids)}"
        self._incoming: "queue.SimpleQueue[Optional[Tuple[int, Done, Held]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._poll, name="bytescheduler-horovod-poll", daemon=True)
        self._thread.start()

    def launch(self, op: Operation, done: Done) -> None:
        if len(op.pieces) != 1:
            raise ValueError("the Horovod backend takes one piece per operation (merge=False)")
        piece = op.pieces[0]
        view = piece.task.payload.narrow(0, piece.start, piece.stop - piece.start)
        held = Held(view)  # see horovod_hold.py: Horovod must never need the GIL to let go of it
        handle = hvd.allreduce_async_(held.tensor, name=f"{self.name}.{piece.task.key}.{piece.start}", op=self._op,
                                      **self._factors)
        self._incoming.put((handle, done, held))

    def _poll(self) -> None:
        """Learn completions in launch order: Horovod's one background thread runs the
        operations every rank submitted in the same order, so each wake-up polls only the
        oldest one (and those after it once it is done), not every operation in flight."""
        waiting: Deque[Tuple[int, Done, Held]] = deque()
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
            finished = 0
            while waiting and hvd.poll(waiting[0][0]):
                handle, done, held = waiting.popleft()
                finished += 1
                try:
                    hvd.synchronize(handle)
                except BaseException as error:  # noqa: BLE001
                    done(error)
                    continue
                held.release()
                done(None)
            # Poll fast while operations finish, back off to 1 ms while they are slow.
            pause = 1e-5 if finished else min(pause * 2, 1e-3)
            if waiting:
                time.sleep(pause)

    def close(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=10)


def _wait_for(handle: int, cancel: Optional[threading.Event], timeout: float, what: str, held: Held,
              spin_seconds: float = _SPIN_SECONDS) -> Any:
    """Wait for a Horovod handle; its result (Horovod's ``synchronize``), or False if
    ``cancel`` was set. ``held`` holds the operation's tensors: let go once it succeeded
    (see :mod:`~bytescheduler.pytorch.horovod_hold`).

    For the first ``spin_seconds`` (default :data:`_SPIN_SECONDS`) it polls between
    ``sched_yield`` calls, as Horovod's own ``synchronize`` does: the core never idles, so
    the completion is seen at once (sleeping instead lets the core idle, and waking it costs
    the plain path a noticeable share of a small model's iteration). Past that it polls with
    a growing pause (at most 1 ms), so a long wait does not hold the core. The plain path's
    waits in ``step()`` spin to the deadline, as ``synchronize`` does: an all-reduce of a
    large gradient on a slow link lasts longer than 50 ms, and sleeping there costs a share
    of every iteration.

    Raises Horovod's error if the operation failed (e.g. a peer died), or
    :class:`CommunicationTimeout` after ``timeout`` seconds.
    """
    result = _poll_until_done(handle, cancel, timeout, what, spin_seconds)
    if result is not False:
        held.release()
    return result


def _timed_out(what: str, timeout: float, earlier: bool = False) -> CommunicationTimeout:
    """The error of a wait past its deadline (``earlier``: an earlier wait's, still not over)."""
    late = (f"is still waiting for an earlier one that did not finish within {timeout} s" if earlier
            else f"did not finish within {timeout} s")
    return CommunicationTimeout(f"rank {hvd.rank()}: {what} {late}; a peer may have died or stopped training "
                                "(set BYTESCHEDULER_TIMEOUT to change the limit)")


def _poll_until_done(handle: int, cancel: Optional[threading.Event], timeout: float, what: str,
                     spin_seconds: float) -> Any:
    """The polling of :func:`_wait_for` (which see)."""
    start = time.monotonic()
    spin_until, deadline = start + spin_seconds, start + timeout
    pause = 1e-5
    while not hvd.poll(handle):
        if cancel is not None and cancel.is_set():
            return False
        now = time.monotonic()
        if now > deadline:
            raise _timed_out(what, timeout)
        if now < spin_until:
            os.sched_yield()
            continue
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    result = hvd.synchronize(handle)
    return True if result is None else result


class HorovodOrderChannel:
    """:class:`~bytescheduler.core.ordering.OrderChannel` over Horovod broadcasts from rank 0.

    Each message goes as one or more int64 frames, broadcast under rotating names
    ``{prefix}.{n}`` that every rank counts alike.
    """

    def __init__(self, prefix: str, timeout: float) -> None:
        self._prefix = prefix
        self._timeout = timeout
        self._sequence = 0
        self._sent: Deque[Tuple[int, Held]] = deque()  # leader: broadcasts not yet finished
        self._buffer = torch.zeros(_ORDER_WORDS, dtype=torch.int64)
        self._epochs = itertools.count()

    @property
    def is_leader(self) -> bool:
        return hvd.rank() == 0

    def new_epoch(self) -> int:
        return next(self._epochs)

    def _name(self) -> str:
        name = f"{self._prefix}.{self._sequence % _ORDER_NAMES}"
        self._sequence += 1
        return name

    def publish(self, message: Sequence[int]) -> None:
        """Broadcast ``message`` (leader only); returns without waiting for the followers."""
        while self._sent and hvd.poll(self._sent[0][0]):
            self._finish_oldest()  # raises if the broadcast failed
        for frame in frame_tensors(message, _ORDER_WORDS):
            if len(self._sent) >= _ORDER_NAMES:  # its name is about to be reused
                self._finish_oldest()
            held = Held(frame)
            self._sent.append((hvd.broadcast_async_(held.tensor, root_rank=0, name=self._name()), held))

    def _finish_oldest(self) -> None:
        handle, held = self._sent.popleft()
        _wait_for(handle, None, self._timeout, "an ordering broadcast", held)

    def receive(self, cancel: threading.Event) -> Optional[List[int]]:
        """Receive rank 0's next message (followers only); None once ``cancel`` is set."""
        message: List[int] = []
        while True:
            frame = self._buffer
            held = Held(frame)
            handle = hvd.broadcast_async_(held.tensor, root_rank=0, name=self._name())
            # No deadline here: the scheduler fails a follower whose tensors wait too long.
            if _wait_for(handle, cancel, float("inf"), "receiving rank 0's order", held) is False:
                return None
            if not read_frame(frame.tolist(), message):
                return message

    def close(self) -> None:
        """Wait for the leader's last broadcasts (after a clean stop, every follower takes them)."""
        while self._sent:
            self._finish_oldest()


class HorovodReducer:
    """The plain path's :class:`~bytescheduler.pytorch.plain.Reducer` over Horovod: what
    ``hvd.DistributedOptimizer`` does, one named ``allreduce_async_`` per gradient (Horovod's
    background thread fuses them), waited for in ``step()``, but with a deadline: Horovod
    itself would wait for a stalled peer forever."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self._prefix = prefix
        self._timeout = timeout

    def start(self, items: Sequence[Tuple[int, torch.Tensor]]) -> Any:
        started = []
        for key, grad in items:
            held = Held(grad)
            started.append((held, hvd.allreduce_async_(held.tensor, name=f"{self._prefix}.{key}", op=hvd.Average)))
        return started

    def wait(self, started: List[Tuple[Held, int]], assign: Any = None) -> None:  # Horovod averages in place
        for held, handle in started:
            _wait_for(handle, None, self._timeout, "an all-reduce of Horovod's own path", held,
                      spin_seconds=math.inf)


class _Synchronizer:
    """Runs Horovod's ``synchronize`` on a thread of its own while the training thread waits for
    it with a deadline.

    ``synchronize`` waits in C++ (polling between yields, the GIL released) and has no
    deadline. Polling the same handles from Python with a deadline would cost about the same,
    but this way the wait is Horovod's own loop by construction. The training thread
    sleeps on the call's future while this thread waits, which keeps the core busy (no idle
    wake-up); the hand-over costs two thread switches per step. When the deadline passes, the
    training thread raises; this thread stays in ``synchronize`` (a stalled peer may still come
    back) and every later call raises at once until it returned.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._runner: Optional[CallThread] = None  # started by the first call, stopped by close()
        self._last: Optional[Future] = None  # the last call's, each call its own

    def _idle(self) -> bool:
        return self._last is None or self._last.done()

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> None:
        """``fn()`` on this thread; its exception raised here; CommunicationTimeout after ``timeout`` s."""
        if not self._idle():
            raise _timed_out(what, timeout, earlier=True)
        if self._runner is None:
            self._runner = CallThread(self._name)
        self._last = future = self._runner.submit(fn)
        try:
            future.result(timeout)
        except FutureTimeout:
            raise _timed_out(what, timeout) from None

    def close(self) -> None:
        """Stop the thread, unless it is still in a call that timed out (a daemon, it then ends
        with the process)."""
        if self._runner is not None and self._idle():
            self._runner.close()
            self._runner = None


class HorovodHooks:
    """The plain path run by the user's ``hvd.DistributedOptimizer`` itself: its own gradient
    hooks launch the all-reduces (turned on by :meth:`enter`, off again by :meth:`leave`, through
    its public ``set_backward_passes_per_step``), and its own ``synchronize`` puts the averages
    in place (:meth:`finish`, called at the end of backward, so that gradients read after it are
    averaged, as on our buckets). Launching the same all-reduces from our hooks (behind Horovod's
    silenced ones) and waiting for them in our last gradient hook cost 3-4% of an iteration more
    than Horovod on cnn-small at 1 Gbit/s, where Horovod keeps the cores 100% busy; this path
    costs 1-2%.

    One thing is ours: ``synchronize`` (which would wait for a stalled peer forever) runs on a
    thread of its own (:class:`_Synchronizer`) while the training thread waits for it with the
    deadline. It launches what a hook did not (a parameter without a gradient this step on this
    rank: Horovod all-reduces zeros for it), waits for every all-reduce and puts the averages in
    place, all as ``hvd.DistributedOptimizer.step`` would. Private fields read: ``_handles``
    (see :func:`_unwrap`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, passes: int, timeout: float) -> None:
        self._optimizer = optimizer  # the hvd.DistributedOptimizer object (its class's methods)
        self._passes = passes
        self._timeout = timeout
        self._synchronizer = _Synchronizer(f"bytescheduler-hvd-sync-r{hvd.rank()}")

    def enter(self) -> None:
        self._optimizer.set_backward_passes_per_step(self._passes)

    def leave(self) -> None:
        _silence(self._optimizer)

    def finish(self, launched_only: bool = False) -> None:
        optimizer = self._optimizer
        try:
            if launched_only and not any(handle is not None for handle, _ in optimizer._handles.values()):
                return
            self._synchronizer.call(optimizer.synchronize, self._timeout, "an all-reduce of Horovod's own path")
        except Exception as error:  # noqa: BLE001 - a failed collective: a peer died or the network failed
            raise as_library_error(error, hvd.rank()) from error

    def close(self) -> None:
        self._synchronizer.close()


def _plain_setup(prefix: str, config: SchedulerConfig, hooks: Optional[HorovodHooks] = None) -> PlainSetup:
    """The mode switch over Horovod: its own path (``hooks``: run by the user's
    ``hvd.DistributedOptimizer``; else by our reducer, for a plain torch optimizer), and one
    all-gather of [proposal, veto] to agree (waited for with ``config.timeout``, as every
    operation of ours); ``config.start_plain``: start on it."""
    timeout = config.timeout

    def agree(proposal: int, veto: bool) -> int:
        held = Held(torch.tensor([[proposal, int(veto)]], dtype=torch.int64))
        handle = hvd.allgather_async(held.tensor, name=f"{prefix}.mode")
        votes = _wait_for(handle, None, timeout, "the mode switch's agreement", held)
        return STOP if int(votes[:, 1].max()) else int(votes[0, 0])

    return PlainSetup(HorovodReducer(prefix, timeout), agree, first_bytes=0, bucket_bytes=0,
                      start_plain=config.start_plain, mode_switch=config.mode_switch, hooks=hooks)


def _order_channel(prefix: str, timeout: float) -> Any:
    """Rank 0's order: TCP if every rank reaches rank 0, else Horovod broadcasts (collective)."""
    names = itertools.count()

    def share(offer: Any) -> Any:
        return hvd.broadcast_object(offer, root_rank=0, name=f"{prefix}.share.{next(names)}")

    def gather(flag: Any) -> List[Any]:
        return hvd.allgather_object(flag, name=f"{prefix}.gather.{next(names)}")

    # horovodrun's gloo rendezvous server runs where every rank reached it.
    peer = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or os.environ.get("MASTER_ADDR")
    channel = connect(hvd.rank(), hvd.size(), share, gather, peer, timeout)
    return channel if channel is not None else HorovodOrderChannel(prefix, timeout)


def _unwrap(optimizer: torch.optim.Optimizer) -> Tuple[type, int]:
    """The user's optimizer class under Horovod's dynamic subclass, and its accumulation count.

    Horovod's ``DistributedOptimizer`` is recognised by its public methods; its own
    gradient hooks are turned off later (:func:`_silence`) through its public
    ``set_backward_passes_per_step`` (a countdown that never reaches zero: the hooks,
    registered on the autograd graph, cannot be removed), and ``op``, ``gradient_predivide_factor`` and ``process_set`` are
    public attributes. Horovod has no public accessor for two settings we must refuse, so
    these two private fields are read: ``_compression`` and ``_groups`` (and, on Horovod's own
    path, ``_handles``: :class:`HorovodHooks`).
    """
    if not _is_horovods(optimizer):
        return type(optimizer), 1
    if getattr(optimizer, "_groups", None) is not None:
        raise ValueError("bytescheduler does not support hvd.DistributedOptimizer(groups=...) (or num_groups=): "
                         "it schedules each gradient itself; leave groups unset")
    if getattr(optimizer, "_compression", hvd.Compression.none) is not hvd.Compression.none:
        raise ValueError("bytescheduler does not support Horovod compression; use hvd.Compression.none")
    if getattr(optimizer, "op", None) not in (hvd.Average, hvd.Sum):  # Adasum's optimizer has no ``op``
        raise ValueError("bytescheduler sums or averages gradients piece by piece; hvd.DistributedOptimizer(op=...) "
                         "must be hvd.Average or hvd.Sum (Adasum combines whole gradients)")
    if getattr(optimizer, "process_set", hvd.global_process_set) is not hvd.global_process_set:
        raise ValueError("bytescheduler supports Horovod's global process set only")
    return type(optimizer).__bases__[0], int(optimizer.backward_passes_per_step)


def _is_horovods(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an ``hvd.DistributedOptimizer`` (told by its public methods)."""
    return all(hasattr(optimizer, name) for name in ("set_backward_passes_per_step", "skip_synchronize",
                                                     "synchronize"))


def _reduction(optimizer: torch.optim.Optimizer) -> Tuple[Any, float, float]:
    """The op, prescale and postscale factors of Horovod's all-reduces for ``optimizer``: what
    ``hvd.DistributedOptimizer`` passes (``gradient_predivide_factor`` splits an average into
    a division before the sum and one after); a plain optimizer's gradients are averaged."""
    if not _is_horovods(optimizer):
        return hvd.Average, 1.0, 1.0
    if optimizer.op is not hvd.Average:
        return optimizer.op, 1.0, 1.0
    factor = optimizer.gradient_predivide_factor
    return hvd.Average, 1.0 / factor, factor


def _silence(optimizer: torch.optim.Optimizer) -> None:
    """Turn off the gradient hooks of a Horovod ``DistributedOptimizer`` (see :func:`_unwrap`)."""
    passes = int(optimizer.backward_passes_per_step)
    optimizer.set_backward_passes_per_step(_NEVER)
    optimizer.backward_passes_per_step = passes  # what the user set stays readable


class _Backward:
    """Whether a backward pass produced a gradient since Horovod's optimizer would have last
    cleared its handles (``step()``, ``synchronize()``, ``load_state_dict()``): ``param`` is set
    by a gradient hook that is a C call (``functools.partial(setattr, ...)``), not a Python
    function, so it costs next to nothing per parameter."""

    __slots__ = ("param",)

    def __init__(self) -> None:
        self.param: Optional[torch.Tensor] = None


class _HorovodState:
    """What the methods of :class:`_HorovodMethods` keep: the flags of Horovod's own optimizer
    (``synchronized``: ``synchronize()`` was called since the last ``step()``; ``skip``: inside
    ``skip_synchronize()``) and the backward tracker with its hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.synchronized = False
        self.skip = False
        self.backward = _Backward()
        hook = functools.partial(setattr, self.backward, "param")
        self.handles = [param.register_post_accumulate_grad_hook(hook)
                        for group in optimizer.param_groups for param in group["params"] if param.requires_grad]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _HorovodMethods:
    """``hvd.DistributedOptimizer``'s methods beyond torch's, with its warnings and errors, on
    a ScheduledOptimizer over one (mixed into its class: :func:`_with_horovod_methods`).
    ``_bytescheduler_horovod`` is the :class:`_HorovodState`."""

    def synchronize(self) -> None:
        """Wait until every gradient in flight is averaged and every called step's update
        applied; a ``step()`` after it, outside :meth:`skip_synchronize`, warns (as Horovod's)."""
        super().synchronize()
        state = self._bytescheduler_horovod
        state.synchronized = True
        state.backward.param = None

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Say that ``step()`` follows a ``synchronize()`` of the user's (no warning then).

        >>> optimizer.synchronize()                                                    # doctest: +SKIP
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)                      # doctest: +SKIP
        >>> with optimizer.skip_synchronize():                                          # doctest: +SKIP
        ...     optimizer.step()
        """
        state = self._bytescheduler_horovod
        state.skip = True
        try:
            yield
        finally:
            state.skip = False

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """Start this step's updates (see the scheduled ``step``); warns as Horovod's does when
        called after ``synchronize()`` outside :meth:`skip_synchronize`."""
        state = self._bytescheduler_horovod
        if state.synchronized and not state.skip:
            warnings.warn("optimizer.step() after optimizer.synchronize(), outside the optimizer.skip_synchronize() "
                          "context: hvd.DistributedOptimizer would synchronize a second time here, which slows "
                          "training; when you call synchronize() yourself, run step() inside "
                          "`with optimizer.skip_synchronize():`", UserWarning, stacklevel=2)
        state.synchronized = False
        state.backward.param = None
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused, as Horovod refuses it, between a backward and the
        ``step()`` or ``synchronize()`` that follows it."""
        if self._bytescheduler_horovod.backward.param is not None:
            raise AssertionError("optimizer.zero_grad() after loss.backward() and before optimizer.step() or "
                                 "optimizer.synchronize() is refused, as hvd.DistributedOptimizer refuses it: the "
                                 "gradients of that backward are still being averaged. Call step() or synchronize() "
                                 "first, or zero the gradients before backward()")
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter; the number is fixed when bytescheduler wraps the optimizer, so only
        the number in force is accepted."""
        current = self._bytescheduler.backward_passes_per_step
        if passes != current:
            raise ValueError(f"set_backward_passes_per_step({passes!r}): bytescheduler fixes the number of "
                             f"backward passes per step when it wraps the optimizer (here {current}); to accumulate "
                             f"over {passes!r}, close() this optimizer and wrap again with "
                             f"ScheduledOptimizer(..., backward_passes_per_step={passes!r})")

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        state = self._bytescheduler_horovod
        state.synchronized = state.skip = False
        state.backward.param = None

    def close(self, wait: bool = True) -> None:
        try:
            super().close(wait)
        finally:
            self._bytescheduler_horovod.remove()

    @staticmethod
    def find_duplicates(names):
        """The names that occur more than once in ``names`` (Horovod's check of ``named_parameters``)."""
        seen, duplicates = set(), set()
        for name in names:
            (duplicates if name in seen else seen).add(name)
        return duplicates


def _with_horovod_methods(wrapped: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``wrapped``, its class now with :class:`_HorovodMethods` first (same name, same
    ``isinstance``): the returned optimizer has ``hvd.DistributedOptimizer``'s surface."""
    cls = type(wrapped)
    wrapped._bytescheduler_horovod = _HorovodState(wrapped)
    wrapped.__class__ = type(cls.__name__, (_HorovodMethods, cls), {"__doc__": cls.__doc__})
    return wrapped


def ScheduledOptimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_steps: Optional[int] = None,
    backward_passes_per_step: Optional[int] = None,
    broadcast_parameters: bool = True,
    config: Optional[SchedulerConfig] = None,
    **options: Any,
):
    """Wrap ``hvd.DistributedOptimizer(optimizer)`` (or a plain optimizer) for scheduled overlap.

    Args:
        model: the model whose parameters the optimizer trains.
        optimizer: an ``hvd.DistributedOptimizer`` (its class, hyperparameters, state and
            ``backward_passes_per_step`` are kept) or a plain torch optimizer.
        num_steps: deprecated, ignored (the original API's): nothing needs to know when
            training ends; call ``close()`` at the end. Given, it warns once
            (``FutureWarning``); it will be removed.
        backward_passes_per_step: defaults to the Horovod optimizer's.
        broadcast_parameters: copy rank 0's parameters and buffers to every rank first.
        config, **options: the scheduler's options (``partition_bytes=``, ``credit_bytes=``,
            ``timeout=``, ...; see :class:`bytescheduler.core.SchedulerConfig`); rank 0's
            decide. Unset ones come from the environment or :data:`HOROVOD_DEFAULTS`
            (8 MiB pieces, a 16 MiB credit, ``adaptive``: rank 0 runs Horovod's own path
            instead where that is faster). ``merge`` is off: Horovod fuses by itself.

    Returns an instance of the user's optimizer class; over an ``hvd.DistributedOptimizer``
    it also has Horovod's methods (``skip_synchronize()``, ``set_backward_passes_per_step``,
    ...) with Horovod's warnings and errors (:class:`_HorovodMethods`; docs/optimizer.md).
    """
    if num_steps is not None:
        warnings.warn(
            "bytescheduler.pytorch.horovod.ScheduledOptimizer: num_steps is deprecated and ignored (nothing needs "
            "to know when training ends; call optimizer.close() at the end); drop the argument",
            FutureWarning, stacklevel=2)
    init()
    require_numpy()  # Horovod's allgather_object reads through numpy
    unwrapped = {}

    def build():
        if options.get("merge") is not None and parse_bool(options["merge"], "merge"):
            raise ValueError("merge=True does not apply to Horovod, which fuses tensors itself "
                             "(HOROVOD_FUSION_THRESHOLD); leave merge unset")
        if hasattr(optimizer, "_bytescheduler"):
            raise TypeError("this optimizer is already wrapped by bytescheduler: use it as it is "
                            "(wrapping it again would apply every update twice)")
        unwrapped["base"], unwrapped["passes"] = _unwrap(optimizer)
        unwrapped["reduction"] = _reduction(optimizer)
        check_arguments(model, optimizer, backward_passes_per_step or unwrapped["passes"])
        settings = SchedulerConfig.build(config, defaults=HOROVOD_DEFAULTS, **options).with_options(merge=False)
        check_writable(settings.timeline, hvd.rank())
        return settings, param_layout(model)

    # Checked, then agreed (rank 0's shared settings, the same model): an error on one rank
    # reaches every rank, instead of a wait in Horovod's next collective (core/agreement.py).
    report, failure = attempt(build)
    reports = hvd.allgather_object(report, name="bytescheduler.settings") if hvd.size() > 1 else [report]
    config = settle(reports, hvd.rank(), failure)
    base, passes = unwrapped["base"], unwrapped["passes"]
    if base is not type(optimizer):  # a Horovod DistributedOptimizer, not a plain torch one
        optimizer.backward_passes_per_step = backward_passes_per_step or passes  # the number in force
        _silence(optimizer)
    if broadcast_parameters:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    backend = HorovodBackend(*unwrapped["reduction"])
    channel = _order_channel(f"{backend.name}.order", config.timeout) if hvd.size() > 1 else None
    scheduler = Scheduler(backend, channel=channel, rank=hvd.rank(), config=config)
    plain = None
    if config.adaptive and not config.auto_tune and hvd.size() > 1:
        hooks = None if base is type(optimizer) else HorovodHooks(optimizer, backward_passes_per_step or passes,
                                                                  config.timeout)
        plain = _plain_setup(f"{backend.name}.plain", config, hooks)

    def close() -> None:
        try:
            if isinstance(channel, TcpOrderChannel) or (channel is not None and not scheduler.abandoned):
                channel.close()  # a Horovod channel waits for its broadcasts: not after an abandon
        finally:
            backend.close()
            _join_guard.closed(backend)

    def engine(base: type) -> OverlapEngine:
        return OverlapEngine(
            model, optimizer, base, scheduler, hvd.size(), prescale=False,
            backward_passes_per_step=backward_passes_per_step or passes, timeout=config.timeout,
            on_close=close, plain=plain, absence=Absence.HOROVOD,
        )

    _join_guard.opened(backend)
    try:
        wrapped = wrap_optimizer(optimizer, base, engine)
    except BaseException:
        scheduler.stop(wait=False)
        backend.close()
        _join_guard.closed(backend)
        raise
    _join_guard.ready(backend, ShadowJoin(wrapped._bytescheduler, f"{backend.name}.join", config.timeout, _wait_for))
    return wrapped if base is type(optimizer) else _with_horovod_methods(wrapped)
