"""The process groups bytescheduler communicates on, made once per process and reused.

For each set of ranks, :class:`ProcessGroups` holds two lanes (process groups of the
user's backend: gloo runs the operations of one group first in, first out, so a small
urgent piece must not queue behind large ones), a gloo control group, a gloo group for
sparse gradients, and rank 0's order channel over them (:mod:`bytescheduler.pytorch.order`). Creating process groups is
collective, so they are made once and claimed by one scheduler at a time
(:meth:`ProcessGroups.claim`); :meth:`ProcessGroups.release` returns them. A TCP order
channel is connected for each claim and closed on release, so no socket outlives its
scheduler. Our operations
never share a group with the user's own collectives, so the order of the user's calls is
untouched.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..core.log import logger
from ..core.tcp_channel import TcpOrderChannel
from .keeper import Keeper
from .order import GlooOrderChannel, OrderChannel, connect_order_channel

NUM_LANES = 2


def require_initialized() -> None:
    """Raise a clear error unless torch.distributed is initialized (and numpy usable, :func:`require_numpy`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "before creating a bytescheduler hook or optimizer"
        )
    require_numpy()


def require_numpy() -> None:
    """Raise a clear ImportError unless torch can hand a tensor to numpy.

    The object collectives bytescheduler sets up with (torch.distributed's
    ``all_gather_object`` and ``broadcast_object_list``, Horovod's ``allgather_object``)
    read what they received through numpy.
    """
    try:
        import numpy  # noqa: F401 - torch finds it by itself; this names a missing one
        torch.zeros(1, dtype=torch.uint8).numpy()
    except (ImportError, RuntimeError) as error:  # torch: "Numpy is not available"
        raise ImportError(
            f"bytescheduler needs numpy, which torch's object collectives use ({error}): pip install numpy"
        ) from error


class ProcessGroups:
    """Lanes, control group and order channel over ``ranks`` (see the module docstring).

    ``rank`` is this process's position in ``ranks`` (-1 outside them), ``world_size``
    their number. Use :meth:`claim` to get the process's shared instance.

    >>> groups = ProcessGroups.claim(process_group=None, timeout=300.0)   # doctest: +SKIP
    """

    # Per (world, ranks, backend, timeout): instances by index, None where this process is
    # not a member. Indices agree on every process.
    _pools: Dict[tuple, List[Optional["ProcessGroups"]]] = {}
    _pools_lock = threading.Lock()
    _keepalive: List[Any] = []

    @classmethod
    def claim(cls, process_group: Optional[Any] = None, timeout: float = 300.0) -> Optional["ProcessGroups"]:
        """Claim groups for ``process_group`` (default: the whole world).

        Collective over the default group, like ``dist.new_group``: every process calls
        it, in the same order. A process outside ``process_group`` passes what
        ``dist.new_group`` returned to it (``GroupMember.NON_GROUP_MEMBER``) and gets None.
        Processes may pass different groups (e.g. disjoint data-parallel groups). Groups
        are created only when every earlier set for the same ranks is still claimed (two
        schedulers on the same groups could issue in different orders on different ranks).
        """
        require_initialized()
        world = dist.group.WORLD
        group = world if process_group is None else process_group
        mine = None
        report = None
        with cls._pools_lock:
            if group != dist.GroupMember.NON_GROUP_MEMBER:
                mine = (tuple(dist.get_process_group_ranks(group)), dist.get_backend(group), float(timeout))
                pool = cls._pools.get((id(world),) + mine, [])
                # Broken groups are never offered: the reports then make every rank create
                # fresh groups together.
                report = (mine, tuple(i for i, g in enumerate(pool)
                                      if g is not None and not g.claimed and not g.broken))
        # Every process learns what the others want and have free, so all pick the same
        # groups and create the same new ones in the same order.
        reports: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        chosen = None
        with cls._pools_lock:
            for spec in sorted({r[0] for r in reports if r is not None}):
                pool = cls._pools.setdefault((id(world),) + spec, [])
                free = [set(r[1]) for r in reports if r is not None and r[0] == spec]
                common = set.intersection(*free)
                if common:
                    index = min(common)
                else:
                    ranks, backend, seconds = spec
                    created = cls(list(ranks), backend, seconds)
                    pool.append(created if created.rank >= 0 else None)
                    cls._keepalive.append(world)  # the id in the key must not be reused
                    index = len(pool) - 1
                if spec == mine:
                    chosen = pool[index]
                    chosen.claimed = True
        if chosen is not None and chosen.order is None:  # reused: its TCP channel was closed on release
            try:
                chosen.order = connect_order_channel(chosen.rank, chosen.world_size, chosen.ranks[0], chosen.control,
                                                     chosen.keeper, chosen.timeout)
            except BaseException:
                chosen.release(broken=True)
                raise
        return chosen

    def __init__(self, ranks: List[int], backend: str, timeout: float) -> None:
        """Create the lanes, the control group and the order channel (collective, see :meth:`claim`)."""
        self.ranks = ranks
        me = dist.get_rank()
        self.rank = ranks.index(me) if me in ranks else -1
        self.world_size = len(ranks)
        self.backend = backend
        self.timeout = timeout
        span = timedelta(seconds=timeout)
        self.lanes = [dist.new_group(ranks, timeout=span, backend=backend) for _ in range(NUM_LANES)]
        self.control = dist.new_group(ranks, timeout=span, backend="gloo")
        # Sparse gradients, all-reduced outside the scheduler in the adapters' own order (gloo
        # sums sparse tensors; NCCL cannot).
        self.sparse = dist.new_group(ranks, timeout=span, backend="gloo")
        self.keeper = Keeper()
        self.claimed = False
        self.broken = False
        self.order: Optional[OrderChannel] = None
        if self.rank >= 0:
            self.order = connect_order_channel(self.rank, self.world_size, ranks[0], self.control, self.keeper,
                                               timeout)

    def release(self, broken: bool = False) -> None:
        """Return the groups for reuse once their scheduler stopped (``broken``: it was abandoned).

        Operations posted on one rank only (an abandoned schedule) may remain on the groups
        of an abandoned scheduler, so broken groups are never claimed again. Waits until
        gloo has let go of every tensor and callback of the finished operations. A TCP order
        channel is closed (the next claim connects a new one).
        """
        if isinstance(self.order, GlooOrderChannel):
            self.order.release()
        elif isinstance(self.order, TcpOrderChannel):
            self.order.close()
            self.order = None
        if not self.keeper.wait_idle(10.0):
            logger.warning("gloo has not let go of a finished operation's tensors after 10 s")
        with self._pools_lock:
            self.broken = self.broken or broken
            self.claimed = False
