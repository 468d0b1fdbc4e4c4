"""bytescheduler: schedule gradient communication by priority, partition, merge and credit.

The core (:mod:`bytescheduler.core`) imports no framework. The adapters are imported
explicitly, each with its framework:

- :mod:`bytescheduler.pytorch`: ``ScheduledOptimizer`` (torch.distributed) and the DDP
  communication hook (``ScheduledHookState``, ``scheduled_allreduce_hook``);
- :mod:`bytescheduler.pytorch.horovod`: ``ScheduledOptimizer`` over ``hvd.DistributedOptimizer``;
- :mod:`bytescheduler.mxnet.kvstore`: ``ScheduledKVStore`` (MXNet's parameter server).
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
