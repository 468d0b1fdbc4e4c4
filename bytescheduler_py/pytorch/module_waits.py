"""The modules' forward pre-hooks of the scheduled path: a module waits for its own parameters.

Before a module's forward, each of its own parameters (not its children's) whose update is
pending is waited for; nothing else is. The hooks are prepended, so they run before any
forward pre-hook of the user's, which may read the parameters. The plain path, where every
update is done when ``step()`` returns, removes them (:meth:`ModuleWaits.remove`): a module
with no hook at all runs torch's fast call path.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from .params import IDLE, ParamState
from .progress import Progress


class ModuleWaits:
    """The forward pre-hooks on ``model``'s modules that own parameters in ``states``.

    ``progress`` is the engine's :class:`~bytescheduler.pytorch.progress.Progress`: its
    ``busy`` count is the hooks' fast check, its ``wait_readable`` the wait.
    """

    def __init__(self, model: torch.nn.Module, states: Dict[int, ParamState], progress: Progress) -> None:
        self._model = model
        self._states = states
        self._progress = progress
        self._handles: List[Any] = []

    def install(self) -> None:
        """Hook every module that owns parameters (again after :meth:`remove`; new parameters included)."""
        self.remove()
        for module in self._model.modules():
            own = [self._states[id(p)] for p in module.parameters(recurse=False) if id(p) in self._states]
            if own:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(own), prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, own: List[ParamState]) -> Callable:
        progress = self._progress

        def wait_for_own_parameters(module, inputs):
            if progress.busy:
                for state in own:
                    if state.stage != IDLE:
                        progress.wait_readable(state)
        return wait_for_own_parameters
