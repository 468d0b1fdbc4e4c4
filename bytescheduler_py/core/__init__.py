"""The scheduling core. It imports no framework: it sees sizes, priorities and callables.

- :mod:`~bytescheduler.core.policy`: what rank 0 decides (pure: no threads, no clock);
- :mod:`~bytescheduler.core.follower`: how the other ranks replay it (pure);
- :mod:`~bytescheduler.core.scheduler`: the runtime that drives them (threads, lifecycle, errors);
- :mod:`~bytescheduler.core.ordering` and :mod:`~bytescheduler.core.tcp_channel`: how decisions travel;
- :mod:`~bytescheduler.core.task`, :mod:`~bytescheduler.core.partition`, :mod:`~bytescheduler.core.credit`:
  the units and the arithmetic; :mod:`~bytescheduler.core.config`: every option, once.
"""

from .backend import Backend, Done
from .config import SchedulerConfig, parse_size
from .credit import CreditWindow
from .errors import (
    ByteSchedulerError,
    CallbackError,
    CommunicationError,
    CommunicationTimeout,
    ErrorLatch,
    InternalError,
    MismatchError,
    SchedulerClosed,
)
from .follower import Follower
from .ordering import LocalOrderHub, OrderChannel
from .partition import partition_ranges
from .policy import SchedulingPolicy
from .scheduler import Scheduler, State
from .task import Operation, Piece, Task, TaskFuture
from .timeline import Timeline, timeline_path

__all__ = [
    "Backend",
    "ByteSchedulerError",
    "CallbackError",
    "CommunicationError",
    "CommunicationTimeout",
    "CreditWindow",
    "Done",
    "ErrorLatch",
    "Follower",
    "InternalError",
    "LocalOrderHub",
    "MismatchError",
    "Operation",
    "OrderChannel",
    "Piece",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "SchedulingPolicy",
    "State",
    "Task",
    "TaskFuture",
    "Timeline",
    "parse_size",
    "partition_ranges",
    "timeline_path",
]
