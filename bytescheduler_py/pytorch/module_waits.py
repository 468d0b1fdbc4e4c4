"""The modules' forward pre-hooks of the scheduled path: a module waits for its own parameters.

Before a module's forward, each of its own parameters (not its children's) whose update is
pending is waited for; nothing else is. The hooks are prepended, so they run before any
forward pre-hook of the user's, which may read the parameters. The plain path, where every
update is done when ``step()`` returns, removes them (:meth:`ModuleWaits.remove`): a module
with no hook at all runs torch's fast call path.

Under ``torch.compile`` a compiled graph reads all its parameters when it starts, and a
wait per module would break the graph at every module; so there the waits are coarser
(:mod:`bytescheduler.pytorch.compiled`): the root module waits for every pending
parameter, once, before the graph runs, and the other hooks trace to nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List

import torch

from .compiled import CompiledParts, outside_graph, traced_marker, watch
from .params import IDLE, ParamState
from .progress import Progress


class ModuleWaits:
    """The forward pre-hooks on ``model``'s modules that own parameters in ``states``, and
    on ``model`` itself.

    ``progress`` is the engine's :class:`~bytescheduler.pytorch.progress.Progress`: its
    ``busy`` count is the hooks' fast check, its ``wait_readable`` the wait.
    """

    def __init__(self, model: torch.nn.Module, states: Dict[int, ParamState], progress: Progress) -> None:
        self._model = model
        self._states = states
        self._progress = progress
        self._handles: List[Any] = []
        self._coarse = False  # only the root is hooked (compiled modules in the model)
        self.thread = threading.get_ident()  # the training thread
        self._parts = CompiledParts(model)
        watch(self)

    def install(self) -> None:
        """Hook every module that owns parameters (again after :meth:`remove`; new parameters
        included); with compiled modules in the model, the root alone (it waits for all)."""
        self.remove()
        coarse = self._parts.present()
        for module in self._model.modules():
            own = [self._states[id(p)] for p in module.parameters(recurse=False) if id(p) in self._states]
            if module is self._model:
                self._handles.append(module.register_forward_pre_hook(self._root_hook(own), prepend=True))
            elif own and not coarse:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(own), prepend=True))
        self._coarse = coarse

    def compiling(self) -> None:
        """Dynamo is about to compile code on the training thread: let that code read current
        parameters, and if modules of the model are compiled, drop the per-module hooks
        first (:mod:`~bytescheduler.pytorch.compiled` says why)."""
        self.wait_all()
        if self._handles and not self._coarse and self._parts.present():
            self.install()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def wait_all(self) -> None:
        """Wait until every parameter may be read (a compiled graph is about to read them)."""
        if self._handles and self._progress.busy:
            self._progress.wait_all_readable(self._states.values())

    def _root_hook(self, own: List[ParamState]) -> Callable:
        progress = self._progress
        parts = self._parts
        wait_all = outside_graph(self.wait_all)
        traced = traced_marker(parts)

        def wait_at_root(module, inputs):
            if torch.compiler.is_compiling():
                traced()  # runs while dynamo traces: the model is compiled whole
                wait_all()  # one wait before the graph (dynamo may instead run this hook eagerly)
            elif progress.busy:
                if parts.present():
                    self.wait_all()  # a compiled graph follows: it reads all parameters at once
                else:
                    _wait_own(progress, own)
        return wait_at_root

    def _pre_hook(self, own: List[ParamState]) -> Callable:
        progress = self._progress

        def wait_for_own_parameters(module, inputs):
            # Compiled: the root, or the compile itself (compiled.py), waited for everything.
            if not torch.compiler.is_compiling() and progress.busy:
                _wait_own(progress, own)
        return wait_for_own_parameters


def _wait_own(progress: Progress, own: List[ParamState]) -> None:
    for state in own:
        if state.stage != IDLE:
            progress.wait_readable(state)
