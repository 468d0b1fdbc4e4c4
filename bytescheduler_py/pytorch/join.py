"""Uneven inputs: ScheduledOptimizer as a ``torch.distributed.algorithms.Joinable``.

>>> from torch.distributed.algorithms import Join                              # doctest: +SKIP
>>> with Join([optimizer]):                                                     # doctest: +SKIP
...     for x, y in loader:              # some ranks have fewer batches
...         optimizer.zero_grad()
...         loss_fn(model(x), y).backward()
...         optimizer.step()

As with DDP's ``join()``: a rank that ran out of data takes part in each step the others
still run with zeros for every gradient (so their averages divide by the initial world
size, DDP's default), updates nothing itself, and at the end every rank takes the model of
the rank that joined last. Each step the others run is one *round* of the
:class:`~bytescheduler.pytorch.overlap.OverlapEngine` (its ``finish_backward``); an active
rank tells the join context at the first training forward of a round (or when the round
ends without one), before any collective of that round.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from .buffers import broadcast_buffers
from .read_guard import suspended


class JoinSupport:
    """What the wrapped optimizer's ``join_hook``, ``join_device`` and ``join_process_group``
    give ``Join`` (the ``joinable`` is the wrapped optimizer), and the per-round notice."""

    def __init__(self, model: torch.nn.Module, group: Any, buffers_synced: bool) -> None:
        self._model = model
        self.group = group  # the training thread's own gloo group (sparse gradients, buffers)
        self._buffers_synced = buffers_synced and any(True for _ in model.buffers())
        self.joinable: Any = None
        self.engine: Any = None
        self._noticed = 0  # the engine round whose notice was given
        self._handle = model.register_forward_pre_hook(lambda module, inputs: self.notice(), prepend=True)

    def notice(self) -> None:
        """Tell an enabled join context, once per round, that this rank still trains."""
        engine, joinable = self.engine, self.joinable
        if engine is None or joinable is None or not joinable._join_config.enable:
            return
        if not torch.is_grad_enabled() or self._noticed == engine.rounds + 1:
            return
        self._noticed = engine.rounds + 1
        with suspended():
            Join.notify_join_context(joinable)

    def hook(self) -> JoinHook:
        if any(state.sparse for state in self.engine.states.values()):
            raise ValueError("Join with ScheduledOptimizer on a model with sparse gradients is not supported "
                             "(each step averages them in a collective of its own): make them dense")
        if self._buffers_synced:
            raise ValueError(
                "Join with ScheduledOptimizer(broadcast_buffers=True) on a model with buffers is not "
                "supported (DDP then takes the buffers from the last rank still training, which needs "
                "a collective per forward): pass broadcast_buffers=False")
        return _Hook(self)

    def remove(self) -> None:
        self._handle.remove()


class _Hook(JoinHook):
    def __init__(self, support: JoinSupport) -> None:
        self._support = support

    def main_hook(self) -> None:
        """Another rank runs a step: take part with zeros for every gradient."""
        self._support.engine.shadow_round()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: take the parameters and buffers of the rank that joined last."""
        support = self._support
        support.engine.synchronize()
        group = support.group
        rank = torch.tensor([dist.get_rank() if is_last_joiner else -1])
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
        source = int(rank.item())
        tensors = [p.data for p in support._model.parameters()] + list(support._model.buffers())
        if tensors:
            broadcast_buffers(tensors, source, group)


def join_methods(support: Optional[JoinSupport]) -> dict:
    """The Joinable methods of a wrapped optimizer (none without ``support``)."""
    if support is None:
        return {}

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return support.hook()

    return {
        "join_hook": join_hook,
        "join_device": property(lambda self: torch.device("cpu")),
        "join_process_group": property(lambda self: support.group),
    }
