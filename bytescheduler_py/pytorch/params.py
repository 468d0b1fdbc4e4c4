"""The parameters an :class:`~bytescheduler.pytorch.overlap.OverlapEngine` schedules: one
state each, and the autograd hooks on them.

Each parameter moves IDLE -> QUEUED (submitted) -> COMMUNICATED -> (step called, update
applied) -> IDLE; the engine moves it, under its lock.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..core import Task
from .errors import GradientError, undeclared_sparse
from .sparse import SparseParams
from .updates import sub_optimizer

IDLE, QUEUED, COMMUNICATED = 0, 1, 2


class ParamState:
    """One parameter's place in the engine (see the module docstring)."""

    __slots__ = (
        "param", "key", "name", "priority", "group", "sub", "stage", "step_number",
        "passes", "grad", "version", "task", "zero_request", "discard", "sparse",
    )

    def __init__(self, param: torch.nn.Parameter, key: int, name: str, priority: int, group: int) -> None:
        self.param = param
        self.key = key
        self.name = name
        self.priority = priority
        self.group = group
        self.sub: Any = None
        self.stage = IDLE
        self.step_number = 0
        self.passes = 0
        self.grad: Optional[torch.Tensor] = None
        self.version = 0
        self.task: Optional[Task] = None
        self.zero_request: Optional[bool] = None  # set_to_none flag of a deferred zero_grad
        self.discard = False
        self.sparse = False  # averaged at step(), outside the scheduler (sparse.py)


def dense_gradient(state: ParamState) -> Optional[torch.Tensor]:
    """``state``'s gradient as backward left it, made contiguous in place (``p.grad`` becomes
    the contiguous copy); None without one. A sparse gradient of a parameter not declared
    sparse is refused with :class:`~bytescheduler.pytorch.errors.GradientError`."""
    param = state.param
    grad = param.grad
    if grad is None:
        return None
    if grad.is_sparse:
        raise GradientError(undeclared_sparse(state.name))
    if not grad.is_contiguous():
        grad = grad.contiguous()
        param.grad = grad
    return grad


class ParamHooks:
    """The optimizer's parameters (``states``, by ``id``) and every hook the engine put on them.

    ``on_check(state)`` runs before autograd accumulates into ``p.grad`` (the engine refuses
    a gradient that would change one in flight); ``on_gradient(param)`` after it did.
    Parameters are keyed in registration order, prioritised by their position in
    ``model.parameters()`` (forward order for most models).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, base: type, sparse: SparseParams,
                 on_check: Callable[[ParamState], None], on_gradient: Callable[[torch.nn.Parameter], None]) -> None:
        self.states: Dict[int, ParamState] = {}
        self._optimizer = optimizer
        self._base = base
        self._sparse = sparse
        self._on_check = on_check
        self._on_gradient = on_gradient
        self._names = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
        self._order = {id(p): i for i, p in enumerate(model.parameters())}
        self._handles: List[Any] = []
        self._checks: Dict[int, Any] = {}  # key -> handle of the pre-accumulation check
        self.register(0)

    def register(self, first_group: int) -> None:
        """Hook the parameters of the optimizer's groups from ``first_group`` on."""
        for group_index, group in enumerate(self._optimizer.param_groups[first_group:], start=first_group):
            for param in group["params"]:
                if id(param) in self.states or not param.requires_grad:
                    continue
                key = len(self.states)
                priority = self._order.get(id(param), len(self._order) + key)
                state = ParamState(param, key, self._names.get(id(param), f"param{key}"), priority, group_index)
                state.sub = sub_optimizer(self._optimizer, self._base, param, group)
                state.sparse = self._sparse.declared(param)
                self.states[id(param)] = state
                self._hook_check(state)
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_gradient))

    def _hook_check(self, state: ParamState) -> None:
        self._checks[state.key] = state.param.register_hook(lambda grad, state=state: self._on_check(state))

    def check_accumulation(self, on: bool) -> None:
        """Hook (or unhook) the pre-accumulation check of every parameter. The scheduled path
        needs it; the plain path, where a Python call per parameter is measurable on small
        models, checks in its own gradient hook instead."""
        for state in self.states.values():
            handle = self._checks.pop(state.key, None)
            if handle is not None:
                handle.remove()
            if on:
                self._hook_check(state)

    def keep(self, handle: Any) -> None:
        """Another hook of the engine's (a module's forward pre-hook), removed with the others."""
        self._handles.append(handle)

    def remove(self) -> None:
        """Remove every hook (at close)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.check_accumulation(False)
