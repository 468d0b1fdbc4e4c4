"""A follower's receiving thread: rank 0's decisions from the channel to the follower.

It reads only while this rank has tensors waiting for a decision (or the scheduler
drains), so time between iterations (evaluation, checkpoints) never counts against the
channel's timeout, and it ends at rank 0's STOP, on cancellation or on an error.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .follower import Follower
from .ordering import OrderChannel, decode


class DecisionReceiver:
    """Runs the receiving thread of a follower; the owner's lock guards the follower.

    Args:
        channel, epoch: where rank 0's messages come from, and the scheduler's epoch.
        follower: fed every decision (under ``cond``).
        cond: the owner's condition; notified when decisions arrive.
        idle: (lock held) True while there is nothing to read for.
        wait: (lock held) sleeps on ``cond`` for at most the given seconds.
        cancel: set when the owner gives up; the thread then ends promptly.
        fail: called with any error (outside the lock).
    """

    def __init__(self, channel: OrderChannel, epoch: int, follower: Follower, cond: threading.Condition,
                 idle: Callable[[], bool], wait: Callable[[float], None], cancel: threading.Event,
                 fail: Callable[[BaseException], None], name: str, watch_interval: float = 0.5) -> None:
        self._channel = channel
        self._epoch = epoch
        self._follower = follower
        self._cond = cond
        self._idle = idle
        self._wait = wait
        self._cancel = cancel
        self._fail = fail
        self._interval = watch_interval
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        follower = self._follower
        try:
            while True:
                with self._cond:
                    while self._idle() and not self._cancel.is_set():
                        self._wait(self._interval)
                    if self._cancel.is_set():
                        return
                message = self._channel.receive(self._cancel)
                if message is None:
                    return
                decisions = decode(message, self._epoch)
                now = time.perf_counter()
                with self._cond:
                    if decisions is None:
                        follower.stop_received = True
                    else:
                        follower.receive(decisions, now)
                    self._cond.notify_all()
                if decisions is None:
                    return
        except BaseException as error:  # noqa: BLE001 - any failure must reach the user
            self._fail(error)
