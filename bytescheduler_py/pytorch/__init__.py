"""PyTorch adapters: ScheduledOptimizer, the DDP communication hook, the torch.distributed backend.

- :mod:`~bytescheduler.pytorch.optimizer` and :mod:`~bytescheduler.pytorch.overlap`:
  ScheduledOptimizer, the cross-iteration overlap; :mod:`~bytescheduler.pytorch.read_guard`;
- :mod:`~bytescheduler.pytorch.ddp_hook`: the DDP communication hook;
- :mod:`~bytescheduler.pytorch.session`: one scheduler over torch.distributed, built from
  :mod:`~bytescheduler.pytorch.groups` (process groups), :mod:`~bytescheduler.pytorch.order`
  (rank 0's order channel) and :mod:`~bytescheduler.pytorch.backend` (all-reduce);
- :mod:`~bytescheduler.pytorch.horovod`: the same ScheduledOptimizer over Horovod.

>>> import bytescheduler.pytorch as bsp                                     # doctest: +SKIP
>>> ddp_model.register_comm_hook(bsp.ScheduledHookState(), bsp.scheduled_allreduce_hook)  # doctest: +SKIP
"""

from .backend import AllReduceBackend
from .ddp_hook import ScheduledHookState, scheduled_allreduce_hook
from .groups import ProcessGroups
from .optimizer import ScheduledOptimizer
from .errors import GradientError
from .session import TorchSession

__all__ = [
    "AllReduceBackend",
    "GradientError",
    "ProcessGroups",
    "ScheduledHookState",
    "ScheduledOptimizer",
    "TorchSession",
    "scheduled_allreduce_hook",
]
