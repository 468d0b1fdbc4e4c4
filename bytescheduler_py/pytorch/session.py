"""One scheduler over torch.distributed, from claiming the process groups to releasing them.

The path of a gradient: an adapter (the DDP hook, ScheduledOptimizer) submits a task to
the :class:`~bytescheduler.core.scheduler.Scheduler`; on rank 0 its policy decides and
the decision goes straight to the TCP order channel; the dispatcher hands the operation to
:class:`~bytescheduler.pytorch.backend.AllReduceBackend`, which all-reduces it on a lane
of :class:`~bytescheduler.pytorch.groups.ProcessGroups`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch.distributed as dist

from ..core.agreement import ParamInfo, agree
from ..core.config import SchedulerConfig
from ..core.scheduler import Scheduler
from .backend import AllReduceBackend
from .groups import ProcessGroups, require_initialized


def agree_settings(process_group: Optional[Any], config: SchedulerConfig,
                   layout: Optional[Sequence[ParamInfo]] = None) -> SchedulerConfig:
    """Rank 0's shared settings, after checking that every member has the same ``layout``
    (:mod:`bytescheduler.core.agreement`). Collective over the default group, like
    ``dist.new_group``: a process outside ``process_group`` takes part and gets ``config``."""
    require_initialized()
    group = dist.group.WORLD if process_group is None else process_group
    member = group != dist.GroupMember.NON_GROUP_MEMBER
    ranks = tuple(dist.get_process_group_ranks(group)) if member else None
    items: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, (ranks, config, None if layout is None else list(layout)) if member else None)
    if not member:
        return config
    # Processes may pass different groups (disjoint data-parallel groups): mine, in group order.
    everyone = [(items[r][1], items[r][2]) for r in ranks]
    return agree(config, everyone, ranks.index(dist.get_rank()))


class TorchSession:
    """Agrees on the settings, claims groups for ``process_group``, makes the backend and
    starts a scheduler on them.

    Collective over the default group (see :meth:`ProcessGroups.claim`). On a process
    outside ``process_group``, ``scheduler`` is None. ``prepare(groups)`` runs before the
    scheduler starts (e.g. to broadcast rank 0's parameters); if anything fails the groups
    are released again. ``config`` is what every member runs with: rank 0's shared settings
    (:func:`agree_settings`; ``layout`` is compared too).
    """

    def __init__(self, process_group: Optional[Any], config: SchedulerConfig,
                 prepare: Optional[Callable[[ProcessGroups], None]] = None,
                 layout: Optional[Sequence[ParamInfo]] = None) -> None:
        config = agree_settings(process_group, config, layout)
        self.config = config
        self.groups = ProcessGroups.claim(process_group, timeout=config.timeout)
        self.scheduler: Optional[Scheduler] = None
        self._backend: Optional[AllReduceBackend] = None
        if self.groups is None:
            return
        try:
            if prepare is not None:
                prepare(self.groups)
            self._backend = AllReduceBackend(self.groups)
            self.scheduler = Scheduler(self._backend, channel=self.groups.order, rank=self.groups.rank, config=config)
        except BaseException:
            self.release()
            raise

    @property
    def world_size(self) -> int:
        return self.groups.world_size if self.groups is not None else 0

    def release(self) -> None:
        """Give the groups back once the scheduler stopped (as broken if it abandoned work)."""
        if self.groups is None:
            return
        if self._backend is not None:
            self._backend.close()
        abandoned = self.scheduler.abandoned if self.scheduler is not None else False
        self.groups.release(broken=abandoned)

    def close(self, wait: bool = True) -> None:
        """Stop the scheduler (``wait``: finish pending work first), then release the groups."""
        try:
            if self.scheduler is not None:
                self.scheduler.stop(wait=wait)
        finally:
            self.release()
