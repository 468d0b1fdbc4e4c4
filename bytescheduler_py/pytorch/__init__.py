"""PyTorch adapters: ScheduledOptimizer, the DDP communication hook, the torch.distributed backend.

>>> import bytescheduler.pytorch as bsp                                     # doctest: +SKIP
>>> ddp_model.register_comm_hook(bsp.ScheduledHookState(), bsp.scheduled_allreduce_hook)  # doctest: +SKIP
"""

from .comm import TorchCommunicator
from .ddp_hook import ScheduledHookState, scheduled_allreduce_hook
from .optimizer import ScheduledOptimizer
from .overlap import GradientError

__all__ = [
    "GradientError",
    "ScheduledHookState",
    "ScheduledOptimizer",
    "TorchCommunicator",
    "scheduled_allreduce_hook",
]
