"""What one rank computes in an iteration, as the simulator needs it.

A :class:`Profile` lists the model's layers in forward order (the modules that own
parameters): each layer's forward time (from the previous layer's end to its own) and its
gradients, each with its size and the moment in backward it becomes ready, plus the
backward's and the optimizer step's total times. :func:`measure` takes one from a bench
model on this machine (one thread, as each benchmark rank runs); profiles travel as JSON.

>>> p = Profile("two", (Layer("a", 0.1, (Tensor(400, 0.3),)), Layer("b", 0.2, (Tensor(800, 0.1),))), 0.4, 0.05)
>>> round(p.forward_s, 3), p.gradient_bytes, Profile.from_json(p.to_json()) == p
(0.3, 1200, True)
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Tensor:
    """One gradient: its size and when backward has it ready (seconds after backward starts)."""

    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class Layer:
    """A module that owns parameters: its forward time and its gradients."""

    name: str
    forward_s: float
    tensors: Tuple[Tensor, ...]


@dataclass(frozen=True)
class Profile:
    model: str
    layers: Tuple[Layer, ...]
    backward_s: float
    step_s: float

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def gradient_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors)

    @property
    def compute_s(self) -> float:
        """One iteration without communication."""
        return self.forward_s + self.backward_s + self.step_s

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        layers = tuple(Layer(layer["name"], float(layer["forward_s"]),
                             tuple(Tensor(int(t["nbytes"]), float(t["ready_s"])) for t in layer["tensors"]))
                       for layer in data["layers"])
        return cls(data["model"], layers, float(data["backward_s"]), float(data["step_s"]))


def measure(model_name: str, batch_size: int = 32, iterations: int = 5, warmup: int = 2) -> Profile:
    """Profile a bench model (:mod:`bytescheduler_tools.bench.models`) on this machine, one thread.

    Times are the training thread's CPU time (``time.thread_time``; torch runs forward,
    backward and the hooks on it with one thread), the work the simulator gives a core: on a
    shared machine the time other processes take the core is left out.

    Forward hooks time each parameter-owning module's end; post-accumulate-grad hooks time
    each gradient's readiness; medians over ``iterations`` after ``warmup``. Forward time
    outside those modules (activations, the tied logits) counts to the layer it follows.
    """
    import torch
    import torch.nn.functional as F

    from ..bench.models import build

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, make_batch = build(model_name)
    inputs, targets = make_batch(batch_size, torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    owners = [(name or "model", module, [p for p in module.parameters(recurse=False) if p.requires_grad])
              for name, module in model.named_modules()]
    owners = [(name, module, params) for name, module, params in owners if params]
    ends: Dict[int, float] = {}
    ready: Dict[int, float] = {}
    handles = []
    def stamp(table: Dict[int, float], key: int) -> None:  # hooks must return None
        table.setdefault(key, time.thread_time())

    for index, (_, module, params) in enumerate(owners):
        handles.append(module.register_forward_hook(lambda *_, index=index: stamp(ends, index)))
        for param in params:
            handles.append(param.register_post_accumulate_grad_hook(lambda p: stamp(ready, id(p))))
    samples: List[Tuple[List[float], List[List[float]], float, float]] = []
    try:
        for iteration in range(warmup + iterations):
            ends.clear()
            ready.clear()
            optimizer.zero_grad()
            start = time.thread_time()
            loss = F.cross_entropy(model(inputs), targets)
            forward_end = time.thread_time()
            loss.backward()
            backward_end = time.thread_time()
            optimizer.step()
            step_end = time.thread_time()
            if iteration < warmup:
                continue
            forward, last = [], start
            for index in range(len(owners)):
                end = ends.get(index, last)  # a module whose forward never ran (its weight read directly)
                forward.append(max(0.0, end - last))
                last = max(last, end)
            forward[-1] += max(0.0, forward_end - last)
            ready_s = [[ready.get(id(p), backward_end) - forward_end for p in params] for _, _, params in owners]
            samples.append((forward, ready_s, backward_end - forward_end, step_end - backward_end))
    finally:
        for handle in handles:
            handle.remove()
    layers = []
    for index, (name, _, params) in enumerate(owners):
        tensors = tuple(Tensor(p.numel() * p.element_size(),
                               statistics.median(sample[1][index][j] for sample in samples))
                        for j, p in enumerate(params))
        layers.append(Layer(name, statistics.median(sample[0][index] for sample in samples), tensors))
    return Profile(model_name, tuple(layers), statistics.median(s[2] for s in samples),
                   statistics.median(s[3] for s in samples))


def scaled(profile: Profile, factor: float, backward: Optional[float] = None, step: Optional[float] = None) -> Profile:
    """``profile`` with its forward times multiplied by ``factor``, its backward (and every
    gradient's moment in it) by ``backward`` and its step by ``step`` (both default:
    ``factor``): a machine that many times slower in each phase.

    >>> from bytescheduler_tools.sim.profile import Layer, Tensor
    >>> p = Profile("p", (Layer("a", 0.1, (Tensor(4, 0.2),)),), 0.3, 0.05)
    >>> round(scaled(p, 2.0).compute_s, 3), round(scaled(p, 1.0, 1.0, 3.0).compute_s, 3)
    (0.9, 0.55)
    """
    backward = factor if backward is None else backward
    step = factor if step is None else step
    layers = tuple(replace(layer, forward_s=layer.forward_s * factor,
                           tensors=tuple(replace(t, ready_s=t.ready_s * backward) for t in layer.tensors))
                   for layer in profile.layers)
    return Profile(profile.model, layers, profile.backward_s * backward, profile.step_s * step)
