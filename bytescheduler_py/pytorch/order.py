"""Rank 0's order over torch.distributed: a TCP connection, or gloo broadcasts as a fallback.

:func:`connect_order_channel` is collective over a gloo control group. Rank 0 listens on
the address of its route towards the rendezvous host (which every rank reached) and sends
it, over the control group, with a random token; each other rank connects
(:class:`~bytescheduler.core.tcp_channel.TcpOrderChannel`), and every rank reports whether
it connected, so all learn at once and use the same channel. A decision then costs a
socket write, where a gloo broadcast cost each rank ~0.2-0.4 ms of CPU across Python and
gloo's threads, about as much as the all-reduce it announces. Where a rank cannot reach
rank 0 that way, every rank falls back to :class:`GlooOrderChannel`: async broadcasts of
int64 frames on the control group.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..core.ordering import read_frame, to_frames
from ..core.tcp_channel import TcpOrderChannel, connect
from .keeper import Keeper

# int64 words per control frame: [length, more, payload...]. 8 KiB per broadcast.
FRAME_WORDS = 1024


def frame_tensors(message: Sequence[int], words: int) -> List[torch.Tensor]:
    """``message`` as int64 tensors of ``words`` words (no copy of the frames' buffers)."""
    return [torch.frombuffer(frame, dtype=torch.int64) for frame in to_frames(message, words)]


class GlooOrderChannel:
    """:class:`~bytescheduler.core.ordering.OrderChannel` by broadcasts on a gloo group.

    Rank 0 posts each frame with an async broadcast and returns; the others post the
    matching receive. A receive cancelled by a stopping scheduler stays posted inside
    gloo and would swallow the next frame, so the groups are then not reused (the caller
    releases them as broken).
    """

    def __init__(self, rank: int, leader_rank: int, control: Any, keeper: Keeper) -> None:
        self.rank = rank
        self._leader_rank = leader_rank
        self._control = control
        self._keeper = keeper
        self._epochs = itertools.count()
        self._sent: Deque[Tuple[Any, torch.Tensor]] = deque()
        self._receive_buffer = torch.zeros(FRAME_WORDS, dtype=torch.int64)
        self._abandoned: List[torch.Tensor] = []  # buffers gloo never lets go of

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def new_epoch(self) -> int:
        return next(self._epochs)

    def publish(self, message: Sequence[int]) -> None:
        while self._sent and self._sent[0][0].done():
            future, frame = self._sent.popleft()
            self._keeper.watch(frame)
            future.wait()  # raises if the broadcast failed
        for frame in frame_tensors(message, FRAME_WORDS):
            work = dist.broadcast(frame, src=self._leader_rank, group=self._control, async_op=True)
            self._sent.append((work.get_future(), frame))

    def receive(self, cancel: threading.Event) -> Optional[List[int]]:
        message: List[int] = []
        frame = self._receive_buffer
        while True:
            work = dist.broadcast(frame, src=self._leader_rank, group=self._control, async_op=True)
            future = work.get_future()
            arrived = threading.Event()
            future.add_done_callback(self._keeper.wrap(lambda _: arrived.set()))
            while not arrived.wait(0.1):
                if cancel.is_set():
                    self._abandoned.append(frame)
                    self._receive_buffer = torch.zeros(FRAME_WORDS, dtype=torch.int64)
                    return None
            future.wait()  # raises if the leader is gone or the group timed out
            if not read_frame(frame.tolist(), message):
                return message

    def release(self) -> None:
        """A scheduler is done with the channel: hand the frames rank 0 sent to the keeper."""
        while self._sent and self._sent[0][0].done():
            self._keeper.watch(self._sent.popleft()[1])


OrderChannel = Union[TcpOrderChannel, GlooOrderChannel]


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


def connect_order_channel(rank: int, world_size: int, leader_rank: int, control: Any, keeper: Keeper,
                          timeout: float) -> OrderChannel:
    """Connect every rank to rank 0 by TCP, or agree on gloo broadcasts (collective over ``control``).

    ``rank`` is the position in the group, ``leader_rank`` rank 0's global rank.
    """
    def share(offer: Any) -> Any:
        box = [offer]
        dist.broadcast_object_list(box, src=leader_rank, group=control)
        return box[0]

    def gather(flag: Any) -> List[Any]:
        flags: List[Any] = [None] * world_size
        dist.all_gather_object(flags, flag, group=control)
        return flags

    channel = connect(rank, world_size, share, gather, _rendezvous_host(), timeout)
    return channel if channel is not None else GlooOrderChannel(rank, leader_rank, control, keeper)
