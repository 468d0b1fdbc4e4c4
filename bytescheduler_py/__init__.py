"""bytescheduler: schedule gradient communication by priority, partition, merge and credit.

The core (:mod:`bytescheduler.core`) imports no framework; the adapters live in
:mod:`bytescheduler.pytorch` (DDP communication hook) and are imported explicitly.
"""

from .core import (
    ByteSchedulerError,
    CommunicationError,
    CommunicationTimeout,
    MismatchError,
    Scheduler,
    SchedulerClosed,
    SchedulerConfig,
    Task,
)

__version__ = "0.1.0"

__all__ = [
    "ByteSchedulerError",
    "CommunicationError",
    "CommunicationTimeout",
    "MismatchError",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Task",
    "__version__",
]
