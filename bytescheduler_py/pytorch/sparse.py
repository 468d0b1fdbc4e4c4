"""Sparse gradients (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``), as DDP sends them.

A sparse gradient cannot be cut into byte ranges or merged, so it bypasses the scheduler:
at ``step()`` each rank averages the sparse gradients of the declared parameters one by
one, in parameter order (the same on every rank), with the collective an adapter gives
(torch: an all-reduce on a gloo group of their own), exactly as DDP does with its sparse
buckets: the gradient is divided by the world size, all-reduced (gloo sums sparse tensors
by gathering them) and the result becomes ``p.grad``. A rank without a gradient for such a
parameter takes part with an empty one, so the ranks never disagree on the collectives.

>>> sparse_ids(torch.nn.Sequential(torch.nn.Embedding(4, 2, sparse=True), torch.nn.Linear(2, 2))) != set()
True
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Set

import torch

from .errors import GradientError
from .updates import batch_optimizer

Average = Callable[[torch.Tensor], torch.Tensor]


def sparse_ids(model: torch.nn.Module) -> Set[int]:
    """ids of the parameters of modules that declare ``sparse=True`` (their gradients are sparse)."""
    return {id(p) for m in model.modules() if getattr(m, "sparse", False) is True for p in m.parameters(False)}


def average_sparse(states: Iterable[Any], all_reduce: Average, world_size: int, prescale: bool) -> None:
    """Average the gradient of each of ``states`` (``key``, ``param``) in key order; every rank
    calls it at the same step with the same states."""
    for state in sorted(states, key=lambda s: s.key):
        param = state.param
        grad = param.grad
        local = grad is not None
        if grad is None:
            grad = _empty_like(param)
        elif not grad.is_sparse:
            grad = grad.to_sparse()
        if prescale:
            grad.div_(world_size)
        averaged = all_reduce(grad)
        if local or averaged._nnz():
            param.grad = averaged


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    indices = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty((0,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, tuple(param.shape))


class SparseParams:
    """The engine's parameters with sparse gradients: which they are, and their step.

    ``all_reduce`` is the adapter's collective (None: the adapter cannot send sparse
    gradients, and a model with any is refused with :class:`GradientError`).
    """

    def __init__(self, model: torch.nn.Module, all_reduce: Optional[Average], world_size: int, prescale: bool) -> None:
        self._ids = sparse_ids(model)
        if self._ids and all_reduce is None:
            names = sorted(name for name, p in model.named_parameters() if id(p) in self._ids)
            raise GradientError(
                f"parameters {names} get sparse gradients (a module "
                "with sparse=True), which this adapter does not communicate: use sparse=False, or "
                "ScheduledOptimizer over torch.distributed, which averages them as DDP does")
        self._all_reduce = all_reduce
        self._world_size = world_size
        self._prescale = prescale

    def declared(self, param: torch.Tensor) -> bool:
        return id(param) in self._ids

    def step(self, states: Iterable[Any], param_groups: List[dict], apply: bool) -> None:
        """Average the sparse parameters' gradients (``states`` with ``sparse``, ``passes``,
        ``group``, ``sub``); with ``apply``, update each with its group's current values."""
        sparse = [state for state in states if state.sparse]
        if not sparse:
            return
        average_sparse(sparse, self._all_reduce, self._world_size, self._prescale)
        for state in sparse:
            state.passes = 0
            if apply and state.param.grad is not None:
                values = {k: v for k, v in param_groups[state.group].items() if k != "params"}
                batch_optimizer([state], values).step()


def gloo_all_reduce(group: Any) -> Average:
    """The torch adapters' collective: an all-reduce (sum) of a sparse tensor on ``group``."""
    import torch.distributed as dist

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce(grad, group=group, async_op=True).get_future().wait()[0]

    return reduce
