"""``torch.compile`` and the scheduled path: where the waits go when modules are compiled.

A compiled graph reads every parameter it uses when it starts; waiting per module inside it
would need a graph break at each module, and a wait that reads the engine's state would
make dynamo guard on that state and recompile as it changes. So, on the scheduled path:

- inside a compiled region the read guard and the modules' own hooks trace to nothing
  (``torch.compiler.is_compiling()`` is their first check);
- the model compiled whole (``torch.compile(model)``, ``model.compile()``): the root
  module's hook calls :meth:`ModuleWaits.wait_all`, kept out of the graph
  (:func:`outside_graph`): one break, where the graph starts. The break falls in the
  loop of ``Module._call_impl`` that runs the hooks, so dynamo runs the root's
  ``_call_impl``, hooks and all, eagerly and compiles its ``forward``; the root's hook,
  eager then, must know that a graph follows: while dynamo traced the hook, it called
  :func:`traced_marker`'s function, which remembered that;
- parts compiled inside an eager model: the root's eager hook finds them
  (:class:`CompiledParts`) and waits for every parameter before the forward, and the
  other modules' hooks are removed: they would trace to nothing, and a hook (our code)
  on one of torch's own modules makes dynamo compile a module it otherwise runs eagerly
  (``nn.LayerNorm(...).compile()`` called from eager code), which rounds differently;
- a compilation that starts on the training thread first waits for every pending
  parameter too (dynamo's compile-start callback), so that the step on which a part is
  first compiled reads current parameters as well.

A compiled forward therefore waits for the whole update of the last step, not layer by
layer; the gradients still go out as backward produces them. What stays different: the
read guard is a torch function mode, and under one dynamo compiles torch's own modules
compiled alone, as a hook does; compile the model's own blocks, or the whole model.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

import torch

_lock = threading.Lock()
_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()
_compiles = 0  # dynamo compilations started in this process (read without the lock)
_registered = False


class Waits(Protocol):
    thread: int  # the training thread

    def compiling(self) -> None:
        """Dynamo starts compiling on ``thread``: wait for every pending parameter."""


def outside_graph(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run eagerly where compiled code calls it."""
    return torch.compiler.disable(fn, recursive=True)


def watch(waits: Waits) -> None:
    """Let a compilation on ``waits.thread`` first wait for all of ``waits``' parameters."""
    global _registered
    import torch._dynamo  # noqa: F401 - torch imports it at the first optimizer step anyway

    with _lock:
        _watched.add(waits)
        if not _registered:
            handler = getattr(torch._dynamo, "callback_handler", None)
            if handler is not None:
                handler.register_start_callback(_compile_started)
            _registered = True


def _compile_started(args: Any = None) -> None:
    global _compiles
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    if trigger != "DYNAMO":
        return  # a backward compiled lazily, autotuning: no forward reads parameters here
    _compiles += 1
    here = threading.get_ident()
    with _lock:
        waiting = [waits for waits in _watched if waits.thread == here]
    for waits in waiting:
        waits.compiling()


class CompiledParts:
    """Whether ``model``, or modules in it, are compiled: looked for again after each
    compilation, or learnt while dynamo traces the root (:func:`traced_marker`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._seen = -1
        self._present = False
        self.root_traced = False

    def present(self) -> bool:
        if self.root_traced:
            return True
        if self._seen != _compiles:
            self._seen = _compiles
            self._present = any(_is_compiled(module) for module in self._model.modules())
        return self._present


def traced_marker(parts: CompiledParts) -> Callable[[], None]:
    """A function that dynamo calls while it traces (its result is taken as a constant), not
    when the compiled code runs: calling it in compiled code marks ``parts`` as compiled."""

    def traced() -> None:
        parts.root_traced = True

    return torch.compiler.assume_constant_result(traced)


def _is_compiled(module: torch.nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule  # torch.compile(module)

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
