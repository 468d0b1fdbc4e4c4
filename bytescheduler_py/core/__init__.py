"""The scheduling core. It imports no framework: it sees sizes, priorities and callables."""

from .config import SchedulerConfig, parse_size
from .credit import CreditWindow
from .errors import (
    ByteSchedulerError,
    CommunicationError,
    CommunicationTimeout,
    MismatchError,
    SchedulerClosed,
)
from .ordering import LocalOrderHub, OrderChannel
from .partition import partition_ranges
from .scheduler import Backend, Scheduler
from .task import Operation, Piece, Task, TaskFuture
from .timeline import Timeline, timeline_path

__all__ = [
    "Backend",
    "ByteSchedulerError",
    "CommunicationError",
    "CommunicationTimeout",
    "CreditWindow",
    "LocalOrderHub",
    "MismatchError",
    "Operation",
    "OrderChannel",
    "Piece",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Task",
    "TaskFuture",
    "Timeline",
    "parse_size",
    "partition_ranges",
    "timeline_path",
]
