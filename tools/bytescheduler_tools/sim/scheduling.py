"""The scheduler's runtime in simulated time: rank 0's real policy, its dispatcher, completions.

:class:`PolicyDriver` does in simulated time what :class:`~bytescheduler.core.scheduler.Scheduler`
does with real threads: tasks go to :class:`~bytescheduler.core.policy.SchedulingPolicy`
(the very class the runtime uses, not a copy of its rules), the dispatcher thread asks it
for what to launch (again after each batch, after each completion and when a merge hold
ends) and hands each operation to the backend, paying its CPU per operation; a completion
frees the credit and finishes the tasks whose bytes have all arrived.

>>> from bytescheduler.core.config import SchedulerConfig
>>> from bytescheduler_tools.sim.events import Simulation, Wait
>>> sim = Simulation({})
>>> done = []
>>> def launch(op, finished):  # a backend where each operation takes 1 s
...     sim.at(sim.now + 1.0, finished)
>>> driver = PolicyDriver(sim, SchedulerConfig(partition_bytes=4, credit_bytes=8, merge=False, fast_lane_bytes=0),
...                       1, launch, lambda units, now: done.append((units, now)))
>>> driver.submit("a", key=0, nbytes=12, priority=0)   # three pieces of 4 bytes, two at a time
>>> sim.run_until(lambda: bool(done)); done, driver.operations
([(['a'], 2.0)], 3)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.policy import SchedulingPolicy
from bytescheduler.core.task import Operation, Task
from .events import Simulation, Thread, cpu
from .training import Communication, Gradient

# launch(op, finished): start ``op`` on the backend; call ``finished(now)`` when it completed.
Launch = Callable[[Operation, Callable[[float], None]], None]


class PolicyDriver:
    """Rank 0's scheduler: the real policy, a dispatcher thread, and the tasks' completion.

    Args:
        config: the adapter's settings (partition, credit, merge, fast lane, cycle).
        lanes: how many FIFO lanes the backend has (the torch backend 2, Horovod and ps-lite 1).
        launch: starts an operation on the backend.
        on_done: ``on_done(payloads, now)`` once every byte of a task arrived (its payload).
        cpu_per_op: the dispatcher's CPU per operation (with the backend's launch call).
        cpu_per_fused_byte: CPU-seconds per byte the dispatcher copies to fuse pieces.
    """

    def __init__(self, sim: Simulation, config: SchedulerConfig, lanes: int, launch: Launch,
                 on_done: Callable[[List[Any], float], None], cpu_per_op: float = 0.0,
                 cpu_per_fused_byte: float = 0.0) -> None:
        self.sim = sim
        self.policy = SchedulingPolicy(config.partition_bytes, config.credit_bytes, config.merge,
                                       config.fast_lane_bytes, lanes, config.cycle_ms / 1000.0)
        self.dispatcher = Thread(sim, "dispatch")
        self.launch = launch
        self.on_done = on_done
        self.cpu_per_op = cpu_per_op
        self.cpu_per_fused_byte = cpu_per_fused_byte
        self.operations = 0
        self._arrived: Dict[int, int] = {}  # task key -> bytes averaged so far
        self._hold_timer = False
        self._woken = False  # a decision is due at this moment

    def submit(self, payload: Any, key: int, nbytes: int, priority: float, numel: Optional[int] = None,
               itemsize: int = 4) -> None:
        """A task is ready: ``nbytes`` of ``payload`` under ``key`` (unique while in flight), as
        ``numel`` elements of ``itemsize`` bytes (default: float32)."""
        if numel is None:
            numel = max(1, nbytes // itemsize)
        task = Task(key=key, numel=numel, itemsize=itemsize, priority=priority, payload=payload, fuse_key="f32")
        self._arrived[key] = 0
        self.policy.add(task, self.sim.now)
        self.kick(self.sim.now)

    def end_burst(self) -> None:
        """No more tasks soon (the end of backward): stop holding queued work."""
        if self.policy.end_burst():
            self.kick(self.sim.now)

    def kick(self, now: float) -> None:
        """Something changed: the dispatcher decides once this moment's events are all in (as
        the runtime's wakes up a moment after a submit), or after the batch it is launching."""
        if self.dispatcher.idle and not self._woken:
            self._woken = True
            self.sim.at(now, self._wake)

    def _wake(self, now: float) -> None:
        self._woken = False
        if self.dispatcher.idle:
            self._decide(now)

    def _decide(self, now: float) -> None:
        ops = self.policy.decide(now)
        if not ops:
            hold = self.policy.hold_remaining(now)
            if hold > 0 and not self._hold_timer:
                self._hold_timer = True
                self.sim.at(now + hold, self._hold_ended)
            return
        for op in ops:
            self.operations += 1
            seconds = self.cpu_per_op + (self.cpu_per_fused_byte * op.nbytes if len(op.pieces) > 1 else 0.0)
            self.dispatcher.run([cpu("dispatch", seconds, "dispatch")], lambda t, op=op: self._launch(op))
        self.dispatcher.run([], self._decide)  # after the batch, ask again

    def _hold_ended(self, now: float) -> None:
        self._hold_timer = False
        self.kick(now)

    def _launch(self, op: Operation) -> None:
        self.launch(op, lambda t, op=op: self._finished(op, t))

    def _finished(self, op: Operation, now: float) -> None:
        self.policy.finished(op)
        done = []
        for piece in op.pieces:
            task = piece.task
            self._arrived[task.key] += piece.nbytes
            if self._arrived[task.key] == task.nbytes:
                del self._arrived[task.key]
                done.append(task.payload)
        if done:
            self.on_done(done, now)
        self.kick(now)


class ScheduledCommunication(Communication):
    """A system whose gradients go through rank 0's policy: the backward's end ends the burst,
    completed tasks (their payloads: gradients) are averaged. Subclasses launch operations
    on their backend (``_launch``) and submit gradients (``gradient_ready``)."""

    driver: PolicyDriver

    def backward_done(self, now: float) -> None:
        self.driver.end_burst()  # step(): nothing more comes to merge with

    def _launch(self, op: Operation, finished: Callable[[float], None]) -> None:
        raise NotImplementedError

    def _done(self, payloads: List[Gradient], now: float) -> None:
        self.training.communicated(payloads, now)

    @property
    def operations(self) -> int:
        return self.driver.operations
