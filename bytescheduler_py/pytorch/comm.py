"""The torch.distributed backend: all-reduce lanes and the leader's order channel.

One :class:`TorchCommunicator` per process group holds three process groups of its own,
created once per process and reused by every scheduler on that group:

- lane 0 carries large operations, lane 1 small ones: gloo runs the operations of one
  group first in, first out, so a small urgent piece must not queue behind large ones;
- a gloo control group, over which rank 0 sends its address once; the leader's decisions
  then travel over a TCP connection from rank 0 to each other rank
  (:class:`~bytescheduler.core.tcp_channel.TcpOrderChannel`). A decision costs a socket
  write there, where a gloo broadcast cost each rank ~0.2-0.4 ms of CPU across Python and
  gloo's threads, about as much as the all-reduce it announces. Where a rank cannot
  reach rank 0 that way, every rank falls back to async broadcasts of int64 frames on the
  control group.

Our operations never share a group with the user's own collectives, so the order of the
user's calls is untouched.

CUDA tensors (NCCL) are supported by design but untested here (no GPU on our machines):
each launch waits on the event recorded when the tensor became ready, and completion is
learned from an event recorded after the collective, by one waiter thread per lane.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import random
import threading
import time
import weakref
from array import array
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core.errors import CommunicationError, MismatchError
from ..core.log import logger
from ..core.scheduler import Done
from ..core.task import Operation
from ..core.tcp_channel import TcpOrderChannel, local_address

# int64 words per control frame: [length, more, payload...]. 8 KiB per broadcast.
_FRAME_WORDS = 1024
# Seconds the ranks try to set up the TCP order connection before falling back to gloo.
_CONNECT_SECONDS = 20.0


def to_frames(message: Sequence[int], words: int = _FRAME_WORDS) -> List[torch.Tensor]:
    """Cut an ordering message into int64 frames of ``words`` words: [length, more, payload...].

    Built in an ``array`` and wrapped without a copy: the leader publishes a message per
    dispatch, so this runs on the hot path (a tensor filled element by element cost ~8x more).
    """
    payload = words - 2
    frames = []
    for at in range(0, max(len(message), 1), payload):
        chunk = message[at : at + payload]
        buffer = array("q", (len(chunk), 1 if at + payload < len(message) else 0))
        buffer.extend(chunk)
        buffer.frombytes(bytes(8 * (words - len(buffer))))
        frames.append(torch.frombuffer(buffer, dtype=torch.int64))
    return frames


def read_frame(frame: torch.Tensor, message: List[int]) -> bool:
    """Append a received frame's payload to ``message``; True when more frames follow."""
    length, more = frame[:2].tolist()
    if not 0 <= length <= frame.numel() - 2:
        raise MismatchError(f"corrupt ordering frame (length {length})")
    message.extend(frame[2 : 2 + length].tolist())
    return bool(more)


class _Keeper:
    """Knows what gloo's threads still have to let go of, so the process can wait for it.

    A gloo thread takes the GIL after running an operation: to free the done-callback it
    ran, and to drop the reference torch keeps to a tensor's Python object while C++ holds
    the tensor. If the training script has ended by then and the interpreter is being torn
    down, the thread is made to exit inside a C++ destructor and the process aborts
    ("terminate called without an active exception"). So:

    - every callback we hand to torch is wrapped; the wrapper drops its closure as soon as
      it has run (inside the call, where a thread may exit harmlessly) and is recorded, in
      a set changed by single calls (never blocking, never letting go of the GIL), from
      the moment it runs until it is freed;
    - every tensor handed to gloo is watched through a weak reference from its launch on:
      it dies when gloo lets go of it (we hold no other reference, so memory is reused as
      soon as before).

    :meth:`wait_idle` (when a communicator is released, and at exit) waits for both, also
    for operations still in flight after a failure (gloo fails them within its timeout).
    A cancelled receive's buffer, which gloo never lets go of, is kept for the life of
    the process and not waited for.
    """

    def __init__(self) -> None:
        self._live: set = set()
        self._tensors: List["weakref.ReferenceType[torch.Tensor]"] = []
        self._lock = threading.Lock()
        _KEEPERS.add(self)

    def wrap(self, fn: Callable[[Any], None]) -> "_TrackedCallback":
        return _TrackedCallback(fn, self._live)

    def watch(self, tensor: torch.Tensor) -> None:
        """Remember ``tensor`` until gloo has let go of it."""
        with self._lock:
            self._tensors = [ref for ref in self._tensors if ref() is not None]
            self._tensors.append(weakref.ref(tensor))

    def _busy(self) -> bool:
        with self._lock:
            self._tensors = [ref for ref in self._tensors if ref() is not None]
            return bool(self._live or self._tensors)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until gloo's threads let go of everything; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._busy():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True


class _TrackedCallback:
    __slots__ = ("_fn", "_live")

    def __init__(self, fn: Callable[[Any], None], live: set) -> None:
        self._fn = fn
        self._live = live

    def __call__(self, future: Any) -> None:
        fn, self._fn = self._fn, None
        if fn is None:
            return
        self._live.add(id(self))
        fn(future)

    def __del__(self) -> None:
        self._live.discard(id(self))


_KEEPERS: "weakref.WeakSet[_Keeper]" = weakref.WeakSet()


@atexit.register
def _wait_for_gloo() -> None:
    # Runs before the interpreter is torn down, also when a script never closes its
    # scheduler; 5 s in all bounds it if a backend thread is stuck.
    deadline = time.monotonic() + 5.0
    for keeper in list(_KEEPERS):
        keeper.wait_idle(max(0.0, deadline - time.monotonic()))


def _rendezvous_host() -> Optional[str]:
    """The host of torch.distributed's rendezvous store (every rank reached it), if known."""
    try:
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            return store.host
    except (AttributeError, RuntimeError, ValueError):
        pass
    return os.environ.get("MASTER_ADDR")


def _view(piece) -> torch.Tensor:
    return piece.task.payload.narrow(0, piece.start, piece.stop - piece.start)


class _CudaCompletion:
    """Learns when CUDA collectives finish: one thread per lane waits on events in order.

    Operations of one NCCL communicator run in issue order, so waiting in order is exact.
    """

    def __init__(self, lane: int) -> None:
        self._queue: "queue.SimpleQueue[Optional[Tuple[Any, Done]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"bytescheduler-cuda-lane{lane}", daemon=True)
        self._thread.start()

    def put(self, event: Any, done: Done) -> None:
        self._queue.put((event, done))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, done = item
            try:
                event.synchronize()
            except BaseException as error:  # noqa: BLE001
                done(error)
                continue
            done(None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class TorchCommunicator:
    """:class:`~bytescheduler.core.Backend` and order channel over torch.distributed.

    Use :meth:`for_group` to get the process's shared instance for a process group.

    >>> communicator = TorchCommunicator.for_group()          # doctest: +SKIP
    >>> scheduler = Scheduler(communicator, channel=communicator, rank=communicator.rank)  # doctest: +SKIP
    """

    num_lanes = 2
    # Per (world, ranks, backend, timeout): communicators by index, None where this
    # process is not a member. Indices agree on every process.
    _pools: Dict[tuple, List[Optional["TorchCommunicator"]]] = {}
    _pools_lock = threading.Lock()
    _keepalive: List[Any] = []

    @classmethod
    def for_group(
        cls, process_group: Optional[dist.ProcessGroup] = None, timeout: float = 300.0
    ) -> Optional["TorchCommunicator"]:
        """Claim a communicator for ``process_group`` (default: the whole world).

        Collective over the default group, like ``dist.new_group``: every process calls
        it, in the same order. A process outside ``process_group`` passes what
        ``dist.new_group`` returned to it (``GroupMember.NON_GROUP_MEMBER``) and gets None.
        Processes may pass different groups (e.g. disjoint data-parallel groups).

        A communicator serves one scheduler at a time (two schedulers on the same groups
        could issue in different orders on different ranks); :meth:`release` returns it
        for reuse, so groups are created only when every earlier one is still claimed.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "before creating a bytescheduler hook or optimizer"
            )
        world = dist.group.WORLD
        group = world if process_group is None else process_group
        mine = None
        report = None
        with cls._pools_lock:
            if group != dist.GroupMember.NON_GROUP_MEMBER:
                mine = (tuple(dist.get_process_group_ranks(group)), dist.get_backend(group), float(timeout))
                pool = cls._pools.get((id(world),) + mine, [])
                # A broken communicator is never offered: the reports then make every rank
                # create fresh groups together.
                report = (mine, tuple(i for i, c in enumerate(pool)
                                      if c is not None and not c.claimed and not c.broken))
        # Every process learns what the others want and have free, so all pick the same
        # communicator and create the same groups in the same order.
        reports: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        chosen = None
        with cls._pools_lock:
            for spec in sorted({r[0] for r in reports if r is not None}):
                pool = cls._pools.setdefault((id(world),) + spec, [])
                free = [set(r[1]) for r in reports if r is not None and r[0] == spec]
                common = set.intersection(*free)
                if common:
                    index = min(common)
                else:
                    ranks, backend, seconds = spec
                    created = cls(list(ranks), backend, seconds)
                    pool.append(created if created.rank >= 0 else None)
                    cls._keepalive.append(world)  # the id in the key must not be reused
                    index = len(pool) - 1
                if spec == mine:
                    chosen = pool[index]
                    chosen.claimed = True
        return chosen

    def __init__(self, ranks: List[int], backend: str, timeout: float) -> None:
        """Create the lanes and the control group over ``ranks`` (collective, see for_group)."""
        self.ranks = ranks
        me = dist.get_rank()
        self.rank = ranks.index(me) if me in ranks else -1
        self.world_size = len(ranks)
        self.backend = backend
        span = timedelta(seconds=timeout)
        self._lanes = [dist.new_group(ranks, timeout=span, backend=backend) for _ in range(self.num_lanes)]
        self._control = dist.new_group(ranks, timeout=span, backend="gloo")
        self._leader_rank = ranks[0]
        self._sent: Deque[Tuple[Any, torch.Tensor]] = deque()
        self._receive_buffer = torch.zeros(_FRAME_WORDS, dtype=torch.int64)
        self._epochs = itertools.count()
        self.broken = False
        self.claimed = False
        self._cuda: Dict[int, _CudaCompletion] = {}
        self._cuda_lock = threading.Lock()
        self._keeper = _Keeper()
        self._abandoned: List[torch.Tensor] = []
        self._order = self._connect_order_channel(timeout)

    def _connect_order_channel(self, timeout: float) -> Optional[TcpOrderChannel]:
        """Connect every rank to rank 0 by TCP (collective over the control group); None: use gloo.

        Rank 0 listens on every interface and sends the address of its route towards the
        rendezvous host (which every rank reached) over the control group, then accepts on a
        thread of its own while every rank reports whether it connected, so all ranks learn
        at once (also of a failure) and use the same channel.
        """
        if self.rank < 0:
            return None
        channel = TcpOrderChannel(self.rank, timeout)
        offer: List[Any] = [None]
        failures: List[BaseException] = []
        accepting = None
        if self.is_leader:
            token = random.SystemRandom().getrandbits(62)
            port = channel.serve(self.world_size, token=token)
            try:
                host = local_address(_rendezvous_host())
            except OSError:  # e.g. an unresolvable name: the others then fail to connect, and all use gloo
                host = "127.0.0.1"
            offer = [(host, port, token)]

            def accept() -> None:
                try:
                    channel.accept(timeout=_CONNECT_SECONDS)
                except (OSError, CommunicationError) as error:
                    failures.append(error)

            accepting = threading.Thread(target=accept, name="bytescheduler-order-accept", daemon=True)
            accepting.start()
        dist.broadcast_object_list(offer, src=self._leader_rank, group=self._control)
        host, port, token = offer[0]
        if not self.is_leader:
            try:
                channel.join((host, port), token, timeout=_CONNECT_SECONDS)
            except (OSError, CommunicationError) as error:
                failures.append(error)
        connected: List[Any] = [None] * self.world_size
        dist.all_gather_object(connected, not failures, group=self._control)
        if accepting is not None:
            if not all(connected):
                channel.close()  # ends the accept at once
            accepting.join()
        # Every follower that connected was accepted, so rank 0's accept ends when they all did.
        if all(connected):
            return channel
        if failures:
            logger.warning("ordering connection to rank 0 at %s:%d failed (%s); decisions go over gloo",
                           host, port, failures[0])
        channel.close()
        return None

    # ------------------------------------------------------------------ order channel

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def new_epoch(self) -> int:
        if self.broken:
            raise CommunicationError(
                "an earlier scheduler on this process group was abandoned in the middle of "
                "communication (after an error); its groups cannot carry a new schedule: "
                "restart the job"
            )
        return next(self._epochs)

    def publish(self, message: Sequence[int]) -> None:
        """Send ``message`` to every follower (leader only)."""
        if self._order is not None:
            self._order.publish(message)
            return
        while self._sent and self._sent[0][0].done():
            future, frame = self._sent.popleft()
            self._keeper.watch(frame)
            future.wait()  # raises if the broadcast failed
        for frame in to_frames(message):
            work = dist.broadcast(frame, src=self._leader_rank, group=self._control, async_op=True)
            self._sent.append((work.get_future(), frame))

    def receive(self, cancel: threading.Event) -> Optional[List[int]]:
        """Receive the leader's next message (followers only); None once ``cancel`` is set."""
        if self._order is not None:
            message = self._order.receive(cancel)
            if message is None:
                # Messages of the abandoned scheduler may still be on their way.
                self.broken = True
            return message
        message: List[int] = []
        frame = self._receive_buffer
        while True:
            work = dist.broadcast(frame, src=self._leader_rank, group=self._control, async_op=True)
            future = work.get_future()
            arrived = threading.Event()
            future.add_done_callback(self._keeper.wrap(lambda _: arrived.set()))
            while not arrived.wait(0.1):
                if cancel.is_set():
                    # The broadcast stays posted inside gloo and would swallow the next
                    # frame, so this channel must not carry another scheduler's order.
                    self._abandoned.append(frame)  # gloo keeps it: never free it
                    self._receive_buffer = torch.zeros(_FRAME_WORDS, dtype=torch.int64)
                    self.broken = True
                    return None
            future.wait()  # raises if the leader is gone or the group timed out
            if not read_frame(frame, message):
                return message

    # ------------------------------------------------------------------ backend

    def launch(self, op: Operation, done: Done) -> None:
        pieces = op.pieces
        views = [_view(piece) for piece in pieces]
        first = views[0]
        if first.is_cuda:
            self._launch_cuda(op, views, done)
            return
        tensor = first if len(views) == 1 else torch.cat(views)
        work = dist.all_reduce(tensor, group=self._lanes[op.lane], async_op=True)
        self._keeper.watch(tensor)

        def finish(future: torch.futures.Future) -> None:
            try:
                future.wait()
                if len(views) > 1:
                    self._scatter(tensor, views, pieces)
            except BaseException as error:  # noqa: BLE001
                done(error)
                return
            done(None)

        work.get_future().add_done_callback(self._keeper.wrap(finish))

    @staticmethod
    def _scatter(fused: torch.Tensor, views: List[torch.Tensor], pieces) -> None:
        for view, part, piece in zip(views, torch.split(fused, [v.numel() for v in views]), pieces):
            view.copy_(part)
            piece.task.writes += 1

    def _launch_cuda(self, op: Operation, views: List[torch.Tensor], done: Done) -> None:
        stream = torch.cuda.current_stream(views[0].device)
        for piece in op.pieces:
            ready = piece.task.context
            if ready is not None:
                stream.wait_event(ready)
        tensor = views[0] if len(views) == 1 else torch.cat(views)
        work = dist.all_reduce(tensor, group=self._lanes[op.lane], async_op=True)
        self._keeper.watch(tensor)
        work.wait()  # the current stream waits for the collective; the host does not
        if len(views) > 1:
            self._scatter(tensor, views, op.pieces)
        finished = torch.cuda.Event()
        finished.record(stream)
        # Keep the fused buffer alive until the copy back has run.
        finished.fused_buffer = tensor  # type: ignore[attr-defined]
        with self._cuda_lock:
            waiter = self._cuda.get(op.lane)
            if waiter is None:
                waiter = self._cuda[op.lane] = _CudaCompletion(op.lane)
        waiter.put(finished, done)

    def release(self) -> None:
        """Join this communicator's own threads (CUDA waiters) and free it for reuse.

        Call it after the scheduler using it stopped; its groups stay alive for the next.
        """
        with self._cuda_lock:
            waiters, self._cuda = list(self._cuda.values()), {}
        for waiter in waiters:
            waiter.close()
        while self._sent and self._sent[0][0].done():  # watch the order frames sent
            self._keeper.watch(self._sent.popleft()[1])
        if not self._keeper.wait_idle(10.0):
            logger.warning("gloo has not let go of a finished operation's tensors after 10 s")
        with self._pools_lock:
            self.claimed = False
