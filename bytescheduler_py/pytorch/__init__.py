"""PyTorch adapters: the DDP communication hook and the torch.distributed backend.

>>> import bytescheduler.pytorch as bsp                                     # doctest: +SKIP
>>> ddp_model.register_comm_hook(bsp.ScheduledHookState(), bsp.scheduled_allreduce_hook)  # doctest: +SKIP
"""

from .comm import TorchCommunicator
from .ddp_hook import ScheduledHookState, scheduled_allreduce_hook

__all__ = ["ScheduledHookState", "TorchCommunicator", "scheduled_allreduce_hook"]
