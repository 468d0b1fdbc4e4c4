"""What moves the bytes: the protocol every communication backend implements."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from .task import Operation

Done = Callable[[Optional[BaseException]], None]


class Backend(Protocol):
    """Moves the bytes of one operation.

    ``launch`` starts the operation and returns promptly; ``done(None)`` (or
    ``done(exception)``) must be called exactly once when it finished, from any thread,
    possibly before ``launch`` returns. ``num_lanes`` (optional, default 1) is how many
    independent FIFO channels the backend offers; lane 1 carries small operations.
    """

    def launch(self, op: Operation, done: Done) -> None: ...
