"""The scheduling core. It imports no framework: it sees sizes, priorities and callables.

- :mod:`~bytescheduler.core.policy`: what rank 0 decides (pure: no threads, no clock);
- :mod:`~bytescheduler.core.follower`: how the other ranks replay it (pure);
- :mod:`~bytescheduler.core.scheduler` and :mod:`~bytescheduler.core.runtime`: the scheduler
  that drives them, and its threads, lifecycle and errors;
- :mod:`~bytescheduler.core.ordering` and :mod:`~bytescheduler.core.tcp_channel`: how decisions travel;
- :mod:`~bytescheduler.core.task`, :mod:`~bytescheduler.core.partition`, :mod:`~bytescheduler.core.credit`:
  the units and the arithmetic; :mod:`~bytescheduler.core.config`: every option, once.
"""

from .backend import Backend, Done
from .config import SchedulerConfig
from .errors import (
    ByteSchedulerError,
    CallbackError,
    CommunicationError,
    CommunicationTimeout,
    InternalError,
    MismatchError,
    SchedulerClosed,
)
from .modes import ModeSwitchParams
from .scheduler import Scheduler
from .task import Operation, Piece, Task, TaskFuture
from .timeline import Timeline

# What a user of the core needs: a Scheduler over a Backend of one's own (its launch() gets
# Operations of Pieces of Tasks), its options (the mode switch's too), its timeline and its
# errors. The rest is imported from its module (bytescheduler.core.policy, .follower, .ordering, ...).
__all__ = [
    "Backend",
    "ByteSchedulerError",
    "CallbackError",
    "CommunicationError",
    "CommunicationTimeout",
    "Done",
    "InternalError",
    "MismatchError",
    "ModeSwitchParams",
    "Operation",
    "Piece",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Task",
    "TaskFuture",
    "Timeline",
]
