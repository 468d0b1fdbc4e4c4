"""One scheduler over torch.distributed, from claiming the process groups to releasing them.

The path of a gradient: an adapter (the DDP hook, ScheduledOptimizer) submits a task to
the :class:`~bytescheduler.core.scheduler.Scheduler`; on rank 0 its policy decides and
the decision goes straight to the TCP order channel; the dispatcher hands the operation to
:class:`~bytescheduler.pytorch.backend.AllReduceBackend`, which all-reduces it on a lane
of :class:`~bytescheduler.pytorch.groups.ProcessGroups`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist

from ..core.agreement import Layout, Report, attempt, settle
from ..core.config import SchedulerConfig
from ..core.scheduler import Scheduler
from .backend import AllReduceBackend
from .groups import ProcessGroups, require_initialized


def agree_settings(process_group: Optional[Any],
                   build: Callable[[], Tuple[SchedulerConfig, Layout]]) -> Optional[SchedulerConfig]:
    """Run this process's ``build`` (argument checks, settings, model layout), then agree
    with the other members of ``process_group`` (:mod:`bytescheduler.core.agreement`): rank
    0's shared settings, the same layout, and no member failed. Collective over the default
    group, like ``dist.new_group``: a process outside ``process_group`` takes part too and
    gets None. A failure on one rank is raised there as itself and on the others as
    :class:`~bytescheduler.core.errors.RankFailed` naming it, instead of a wait in the next
    collective."""
    require_initialized()
    ranks: Optional[Tuple[int, ...]] = None
    failure: Optional[BaseException] = None
    try:
        ranks = member_ranks(process_group)
    except Exception as error:  # noqa: BLE001 - reported to the others below, raised here
        failure = error
        report: Report = (None, None, f"{type(error).__name__}: {error}")
    if failure is None:
        report, failure = attempt(build) if ranks is not None else ((None, None, None), None)
    items: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, (ranks, report))
    if ranks is None:  # not a member (or a bad process_group, raised below)
        if failure is not None:
            raise failure
        return None
    # Processes may pass different groups (disjoint data-parallel groups): mine, in group order.
    return settle([items[r][1] for r in ranks], ranks.index(dist.get_rank()), failure)


def member_ranks(process_group: Optional[Any]) -> Optional[Tuple[int, ...]]:
    """The global ranks of ``process_group`` (None: the world), or None on a process outside it."""
    if process_group is None:
        return tuple(range(dist.get_world_size()))
    if process_group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed process group (from dist.new_group) or "
                        f"None for the whole world, not {type(process_group).__name__}")
    return tuple(dist.get_process_group_ranks(process_group))


class TorchSession:
    """Claims groups for ``process_group``, makes the backend and starts a scheduler on them.

    Collective over the default group (see :meth:`ProcessGroups.claim`). On a process
    outside ``process_group``, ``scheduler`` is None. ``prepare(groups)`` runs before the
    scheduler starts (e.g. to broadcast rank 0's parameters); if anything fails the groups
    are released again. ``config`` is what the members agreed (:func:`agree_settings`).
    """

    def __init__(self, process_group: Optional[Any], config: SchedulerConfig,
                 prepare: Optional[Callable[[ProcessGroups], None]] = None) -> None:
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


def close_all(closers: List[Callable[..., None]], wait: bool = True) -> None:
    """Call every ``close(wait=...)`` in order; after one fails, the rest drop their pending work.

    For the framework integrations, which each hold several ScheduledOptimizers or hook
    states: every one is closed, and the first error is raised after the last.
    """
    first: Optional[BaseException] = None
    for close in closers:
        try:
            close(wait=wait)
        except BaseException as error:  # noqa: BLE001 - close the others, then raise the first
            first = first or error
            wait = False
    if first is not None:
        raise first
