"""The training thread's compute in ScheduledOptimizer's timeline, so that a recorded run can be simulated.

With ``timeline`` on, besides the scheduler's tasks, queue and lanes, the trace gets spans
of category ``compute``: each parameter-owning module's forward (from when it may start,
after waiting for its parameters, to when the next such module is reached; the last one's
until the model's forward returns), the backward pass (from the model's forward returning
to ``step()``) and each batch of updates on the updater thread. With the task spans (each
gradient's size and ready time) that is what ``bytescheduler simulate --trace`` needs. The
hooks are installed only when a timeline is configured: without one nothing is added.

>>> import torch
>>> from bytescheduler.core.timeline import Timeline
>>> timeline = Timeline("/tmp/compute-timeline-doctest.json", 0)
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> recorder = ComputeTimeline(model, timeline)
>>> _ = model(torch.ones(1, 4)); recorder.step_called(); timeline.close()
>>> import json; spans = [e for e in json.load(open(timeline.path)) if e.get("ph") == "b" and e["cat"] == "compute"]
>>> [(e["name"], e.get("args", {}).get("layer")) for e in spans]
[('0', 0), ('2', 1), ('backward', None)]
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

import torch

from ..core.timeline import Timeline

CATEGORY = "compute"


class ComputeTimeline:
    """Records the forward of each parameter-owning module, the backward and the updates."""

    def __init__(self, model: torch.nn.Module, timeline: Timeline) -> None:
        self.timeline = timeline
        self.handles: List[Any] = []
        self._open: Optional[tuple] = None  # (layer index, name, start) of the module forward running
        self._forward_end: Optional[float] = None
        owners = [(name or "model", module) for name, module in model.named_modules()
                  if any(p.requires_grad for p in module.parameters(recurse=False))]
        for index, (name, module) in enumerate(owners):
            # The first runs before the engine's own pre-hook (which waits for the module's
            # parameters), the second after it: the wait is not compute.
            self.handles.append(module.register_forward_pre_hook(self._arrive, prepend=True))
            self.handles.append(module.register_forward_pre_hook(
                lambda module, inputs, index=index, name=name: self._begin(index, name)))
        self.handles.append(model.register_forward_hook(self._forward_returned))

    def _close_open(self, end: float) -> None:
        if self._open is not None:
            index, name, start = self._open
            self._open = None
            if self.timeline.recording:
                self.timeline.span(CATEGORY, name, start, end, {"layer": index})

    def _arrive(self, module: torch.nn.Module, inputs: Any) -> None:
        if not torch.compiler.is_compiling():  # a compiled forward is not timed per module
            self._close_open(time.perf_counter())

    def _begin(self, index: int, name: str) -> None:
        if not torch.compiler.is_compiling():
            self._open = (index, name, time.perf_counter())

    def _forward_returned(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        now = time.perf_counter()
        self._close_open(now)
        self._forward_end = now

    def step_called(self) -> None:
        """``step()`` was called: the backward pass since the forward returned is over."""
        if self._forward_end is not None and self.timeline.recording:
            self.timeline.span(CATEGORY, "backward", self._forward_end, time.perf_counter())
        self._forward_end = None

    def update(self, start: float, end: float, nbytes: int) -> None:
        """The updater applied ``nbytes`` of parameters from ``start`` to ``end``."""
        if self.timeline.recording:
            self.timeline.span(CATEGORY, "update", start, end, {"bytes": nbytes})

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
