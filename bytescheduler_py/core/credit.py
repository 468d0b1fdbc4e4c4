"""Credit: a window on the bytes in flight."""

from __future__ import annotations


class CreditWindow:
    """At most ``capacity`` bytes in flight; one oversized operation may go alone.

    Not thread-safe on its own: the scheduler guards it with its lock.

    >>> window = CreditWindow(100)
    >>> window.admits(60); window.take(60); window.admits(60)
    True
    False
    >>> window.release(60); window.admits(500)
    True
    """

    __slots__ = ("capacity", "in_flight", "peak")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.peak = 0

    def admits(self, nbytes: int) -> bool:
        return self.in_flight == 0 or self.in_flight + nbytes <= self.capacity

    def take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        if self.in_flight > self.peak:
            self.peak = self.in_flight

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes
