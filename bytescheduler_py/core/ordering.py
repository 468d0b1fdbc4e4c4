"""Same order on every rank: one rank (the leader) decides, the others follow.

Collective backends such as gloo and NCCL match operations by the order in which each
rank issues them, yet gradients become ready at slightly different moments on each rank.
The leader (rank 0) runs the priority queue and the credit on its own readiness and
publishes each batch of decided operations as a message of integers; every follower
issues exactly those operations, in that order, as soon as the tensors they name are
ready locally. No barrier per piece: a follower that is ahead just waits for the
message, one that is behind reads several messages at once.

A message is a flat list of integers:
``[epoch, OPS, n_ops, (lane, n_pieces, (key, generation, start, stop) * n_pieces) * n_ops]``
or ``[epoch, STOP]``. The epoch tells apart schedulers that reuse one channel.

Channels that move fixed-size buffers (a broadcast of an int64 tensor) cut a message into
*frames* of ``words`` int64 each: ``[length, more, payload..., zero padding]``
(:func:`to_frames`, :func:`read_frame`).

>>> frames = to_frames(encode_ops(3, [(0, [(5, 0, 0, 10)])]), words=6)
>>> [list(frame) for frame in frames]
[[4, 1, 3, 1, 1, 0], [4, 1, 1, 5, 0, 0], [1, 0, 10, 0, 0, 0]]
>>> message = []
>>> [read_frame(list(frame), message) for frame in frames], decode(message, epoch=3)
([True, True, False], [(0, [(5, 0, 0, 10)])])
"""

from __future__ import annotations

import queue
import threading
import time
from array import array
from typing import List, Optional, Protocol, Sequence, Tuple

from .errors import CommunicationTimeout, MismatchError

OPS = 1
STOP = 2

# One decided operation: (lane, [(key, generation, start, stop), ...]).
Decision = Tuple[int, List[Tuple[int, int, int, int]]]


class OrderChannel(Protocol):
    """Carries the leader's decisions to the followers, in order.

    ``publish`` is called by the leader only and must not block for long; ``receive``
    by followers only, blocking until the next message arrives (returning None as soon
    as ``cancel`` is set), raising :class:`CommunicationError` when the peer is gone or
    the timeout passes.
    """

    @property
    def is_leader(self) -> bool: ...

    def publish(self, message: Sequence[int]) -> None: ...

    def receive(self, cancel: threading.Event) -> Optional[List[int]]: ...


def encode_ops(epoch: int, decisions: Sequence[Decision]) -> List[int]:
    message = [epoch, OPS, len(decisions)]
    for lane, pieces in decisions:
        message.append(lane)
        message.append(len(pieces))
        for piece in pieces:
            message.extend(piece)
    return message


def encode_stop(epoch: int) -> List[int]:
    return [epoch, STOP]


def decode(message: Sequence[int], epoch: int) -> Optional[List[Decision]]:
    """Return the decisions of an OPS message, or None for STOP."""
    if len(message) < 2 or message[0] != epoch:
        raise MismatchError(
            f"received an ordering message for scheduler epoch {message[0] if message else '?'} "
            f"while this rank runs epoch {epoch}: every rank must create and stop its "
            "schedulers in the same order"
        )
    if message[1] == STOP:
        return None
    if message[1] != OPS:
        raise MismatchError(f"malformed ordering message kind {message[1]}")
    decisions: List[Decision] = []
    count = message[2]
    at = 3
    for _ in range(count):
        lane, n_pieces = message[at], message[at + 1]
        at += 2
        pieces = []
        for _ in range(n_pieces):
            key, generation, start, stop = message[at : at + 4]
            pieces.append((key, generation, start, stop))
            at += 4
        decisions.append((lane, pieces))
    return decisions


def to_frames(message: Sequence[int], words: int) -> List[array]:
    """Cut ``message`` into int64 frames of ``words`` words: ``[length, more, payload..., 0...]``.

    Each frame is an ``array('q')`` (a buffer ``torch.frombuffer`` wraps without a copy):
    rank 0 publishes a message per dispatch, so this is on the hot path.
    """
    payload = words - 2
    frames = []
    for at in range(0, max(len(message), 1), payload):
        chunk = message[at : at + payload]
        frame = array("q", (len(chunk), 1 if at + payload < len(message) else 0))
        frame.extend(chunk)
        frame.frombytes(bytes(8 * (words - len(frame))))
        frames.append(frame)
    return frames


def read_frame(frame: Sequence[int], message: List[int]) -> bool:
    """Append a received frame's payload to ``message``; True when more frames follow."""
    length, more = frame[0], frame[1]
    if not 0 <= length <= len(frame) - 2:
        raise MismatchError(f"corrupt ordering frame (length {length})")
    message.extend(frame[2 : 2 + length])
    return bool(more)


class LocalOrderHub:
    """In-process channels for ranks that are threads of one process (unit tests).

    >>> hub = LocalOrderHub(world_size=2, timeout=1.0)
    >>> hub.channel(0).publish([0, STOP]); hub.channel(1).receive(threading.Event())
    [0, 2]
    """

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._queues = [queue.SimpleQueue() for _ in range(world_size)]

    def channel(self, rank: int) -> "LocalOrderChannel":
        return LocalOrderChannel(self, rank)


class LocalOrderChannel:
    def __init__(self, hub: LocalOrderHub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self._epochs = 0

    def new_epoch(self) -> int:
        self._epochs += 1
        return self._epochs

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def publish(self, message: Sequence[int]) -> None:
        for rank in range(1, self._hub.world_size):
            self._hub._queues[rank].put(list(message))

    def receive(self, cancel: threading.Event) -> Optional[List[int]]:
        deadline = time.monotonic() + self._hub.timeout
        while not cancel.is_set():
            try:
                return self._hub._queues[self.rank].get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise CommunicationTimeout(
                        f"rank {self.rank} received no ordering message from rank 0 within "
                        f"{self._hub.timeout} s"
                    ) from None
        return None
