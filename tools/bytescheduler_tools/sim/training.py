"""One rank's training thread, iteration after iteration, and what its step waits for.

The thread runs each layer's forward, then the backward pass, during which each gradient
becomes ready at its moment (a milestone of the backward's CPU work: on a shared core the
backward slows, and so do the moments). A :class:`Communication` (a system's backend) is
told of each ready gradient and of the end of backward, and reports back which gradients
are averaged. What happens then is the system's :class:`StepMode`:

* ``WAIT``: DDP, Horovod's DistributedOptimizer: the step waits for every gradient, then
  the training thread runs the communication's finishing work (DDP copies its buckets back
  into the gradients) and the optimizer step; the next forward follows.
* ``OVERLAP``: ScheduledOptimizer: ``step()`` returns at once, the updater thread updates
  each parameter as soon as its gradient is averaged, and each layer's next forward waits
  for its own updates only.
* ``SERVER``: a parameter server updates: each layer's next forward waits for its own
  pulls (MXNet's engine orders by data), after copying them into its weights.

>>> from bytescheduler_tools.sim.events import Simulation
>>> from bytescheduler_tools.sim.profile import Layer, Profile, Tensor
>>> profile = Profile("one", (Layer("x", 0.1, (Tensor(4000, 0.2),)),), backward_s=0.3, step_s=0.05)
>>> sim = Simulation({})
>>> class Instant(Communication):  # averages every gradient at once
...     def gradient_ready(self, grad, now): self.training.communicated([grad], now); return 0.0
>>> training = Training(sim, profile, StepMode.WAIT, Instant())
>>> training.start(); sim.run_until(lambda: len(training.starts) > 3); round(training.starts[-1] - training.starts[-2], 3)
0.45
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .events import Simulation, Thread, Work, cpu
from .fluid import CORE
from .profile import Profile


@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient: ``key`` is its position in forward order (the scheduled
    adapters' priority), ``ready_s`` its moment in backward (CPU-seconds of backward done)."""

    key: int
    nbytes: int
    ready_s: float
    layer: int


def gradients(profile: Profile) -> List[Gradient]:
    """Every parameter's gradient, in forward order."""
    out: List[Gradient] = []
    for index, layer in enumerate(profile.layers):
        for tensor in layer.tensors:
            out.append(Gradient(len(out), tensor.nbytes, tensor.ready_s, index))
    return out


class StepMode(enum.Enum):
    WAIT = "the step waits for every gradient"
    OVERLAP = "updates follow each gradient; each layer's forward waits for its own"
    SERVER = "the servers update; each layer's forward waits for its own pulls"


class Communication:
    """What a system's backend offers the training thread; it reports averaged gradients to
    ``self.training.communicated`` (set when the :class:`Training` is made)."""

    training: "Training"

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        """``grad`` is ready; returns CPU-seconds its hook costs the training thread (e.g. a copy)."""
        raise NotImplementedError

    def backward_done(self, now: float) -> None:
        """The backward pass ended (``step()`` is called; ScheduledOptimizer ends the burst)."""

    def finish_cpu(self) -> float:
        """CPU-seconds the training thread spends after the last gradient is averaged (WAIT)."""
        return 0.0

    @property
    def operations(self) -> int:
        """Operations launched so far."""
        return 0


class Training:
    """The training thread (and, for ``OVERLAP``, the updater thread) of one rank.

    Args:
        update_seconds: for ``OVERLAP``: CPU-seconds of the update of each gradient (by key);
            default: the profile's step time shared by bytes.
        copy_seconds: for ``SERVER``: CPU-seconds to copy ``nbytes`` pulled into the weights.
    """

    def __init__(self, sim: Simulation, profile: Profile, mode: StepMode, comm: Communication,
                 update_seconds: Optional[Dict[int, float]] = None,
                 copy_seconds: Callable[[int], float] = lambda nbytes: 0.0) -> None:
        self.sim = sim
        self.profile = profile
        self.mode = mode
        self.comm = comm
        comm.training = self
        self.thread = Thread(sim, "compute")
        self.updater = Thread(sim, "updater")
        self.grads = gradients(profile)
        total = sum(g.nbytes for g in self.grads) or 1
        self.update_seconds = update_seconds if update_seconds is not None else {
            g.key: profile.step_s * g.nbytes / total for g in self.grads}
        self.copy_seconds = copy_seconds
        layers = len(profile.layers)
        self.pending = [0] * layers  # per layer: gradients not yet usable by its next forward
        self.outstanding = 0  # gradients of this iteration not yet averaged
        self.extra_cpu = [0.0] * layers  # work before a layer's next forward (copies of its pulls)
        self.starts: List[float] = []  # when each iteration's first forward began
        self.on_iteration: List[Callable[[float], None]] = []
        self._waiting_layer: Optional[int] = None
        self._step_waits = False
        self._milestones, self._ready_order = self._backward_milestones()

    def _backward_milestones(self) -> Tuple[Tuple[float, ...], List[Gradient]]:
        order = sorted(self.grads, key=lambda g: (g.ready_s, -g.key))
        return tuple(min(g.ready_s, self.profile.backward_s) for g in order), order

    def start(self) -> None:
        self._forward(0, self.sim.now)

    # ------------------------------------------------------------------ forward and backward

    def _forward(self, layer: int, now: float) -> None:
        layers = self.profile.layers
        if layer == len(layers):
            self._backward(now)
            return
        if self.pending[layer] > 0:
            self._waiting_layer = layer
            return
        if layer == 0:
            self.starts.append(now)
            for callback in self.on_iteration:
                callback(now)
        phases = []
        if self.extra_cpu[layer] > 0:
            phases.append(cpu(f"copy into {layers[layer].name}", self.extra_cpu[layer], "copy"))
            self.extra_cpu[layer] = 0.0
        phases.append(cpu(layers[layer].name, layers[layer].forward_s, "forward"))
        self.thread.run(phases, lambda t: self._forward(layer + 1, t), tag=layer)

    def _backward(self, now: float) -> None:
        self.outstanding = len(self.grads)
        if self.mode is not StepMode.WAIT:
            for grad in self.grads:
                self.pending[grad.layer] += 1
        work = Work("backward", self.profile.backward_s, {CORE: 1.0}, "backward", self._milestones, self._gradient)
        self.thread.run([work], self._backward_done)

    def _gradient(self, index: int, now: float) -> float:
        return self.comm.gradient_ready(self._ready_order[index], now)

    def _backward_done(self, now: float) -> None:
        self.comm.backward_done(now)
        if self.mode is StepMode.WAIT:
            self._step_waits = True
            self._maybe_step(now)
        else:
            self._forward(0, now)

    def _maybe_step(self, now: float) -> None:
        if self._step_waits and self.outstanding == 0:
            self._step_waits = False
            phases = [cpu("finish", self.comm.finish_cpu(), "copy"), cpu("step", self.profile.step_s, "step")]
            self.thread.run(phases, lambda t: self._forward(0, t))

    # ------------------------------------------------------------------ communication done

    def communicated(self, grads: List[Gradient], now: float) -> None:
        """``grads`` are averaged (for ``SERVER``: pulled) on this rank."""
        self.outstanding -= len(grads)
        if self.mode is StepMode.WAIT:
            self._maybe_step(now)
        elif self.mode is StepMode.OVERLAP:
            seconds = sum(self.update_seconds[g.key] for g in grads)
            self.updater.run([cpu("update", seconds, "update")], lambda t: self._usable(grads, t))
        else:
            for grad in grads:
                self.extra_cpu[grad.layer] += self.copy_seconds(grad.nbytes)
            self._usable(grads, now)

    def _usable(self, grads: List[Gradient], now: float) -> None:
        for grad in grads:
            self.pending[grad.layer] -= 1
        layer = self._waiting_layer
        if layer is not None and self.pending[layer] == 0:
            self._waiting_layer = None
            self._forward(layer, now)
