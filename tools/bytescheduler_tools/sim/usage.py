"""What a calibration rank spends: wall time, its own threads' CPU, the kernel's interrupt work on
its core, and the CPU of the job's other processes pinned to that core (a parameter server).

Framework-free (the MXNet probe runs without torch). Counting these, rather than the core's
whole busy time, leaves out other people's processes on a shared machine; the kernel's
network work (soft interrupts) is counted, whichever process it serves.

>>> usage = Usage(); _ = sum(range(100000)); phase = usage.stop()
>>> phase["seconds"] > 0 and phase["process_cpu"] >= 0
True
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..bench.common import cpu_busy_seconds, pinned_cpu, thread_cpu_seconds


def interrupt_seconds(cpu: int) -> float:
    """Seconds CPU ``cpu`` has spent in hard and soft interrupts since boot (``/proc/stat``)."""
    prefix = f"cpu{cpu} "
    with open("/proc/stat") as handle:
        for line in handle:
            if line.startswith(prefix):
                irq, softirq = (int(v) for v in line.split()[6:8])
                return (irq + softirq) / os.sysconf("SC_CLK_TCK")
    raise OSError(f"no line for CPU {cpu} in /proc/stat")


def process_seconds(pid: int) -> float:
    """CPU seconds every thread of process ``pid`` has run (0 once it is gone)."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return total


class Usage:
    """Measures a phase: :meth:`start`, then :meth:`stop` returns what it spent.

    ``peers``: pids of the job's other processes on this rank's core (their CPU is reported
    as ``peer_cpu``). ``caller_cpu`` is the CPU of the thread that made the Usage (the one
    calling the operations; Horovod's ``synchronize`` spins on it while it waits).
    ``core_cpu`` is the pinned core's whole busy time (other people's processes included).
    """

    def __init__(self, peers: Optional[List[int]] = None) -> None:
        self.cpu = pinned_cpu()
        self.peers = list(peers or [])
        self.caller = threading.get_native_id()
        self.start()

    def _now(self) -> Dict[str, float]:
        threads = thread_cpu_seconds()
        return {"seconds": time.perf_counter(),
                "core_cpu": cpu_busy_seconds(self.cpu) if self.cpu is not None else 0.0,
                "process_cpu": sum(threads.values()),
                "caller_cpu": threads.get(self.caller, 0.0),
                "interrupt_cpu": interrupt_seconds(self.cpu) if self.cpu is not None else 0.0,
                "peer_cpu": sum(process_seconds(pid) for pid in self.peers)}

    def start(self) -> None:
        self._begin = self._now()

    def stop(self, **extra: float) -> Dict[str, float]:
        end = self._now()
        measured = {name: end[name] - self._begin[name] for name in end}
        measured.update(extra)
        return measured


def _sampled(operation: Callable[[], None], caller: int) -> tuple:
    before = thread_cpu_seconds()
    begin = time.perf_counter()
    operation()
    wall = time.perf_counter() - begin
    after = thread_cpu_seconds()
    return (wall, sum(after.values()) - sum(before.values()), after.get(caller, 0.0) - before.get(caller, 0.0))


def repeat(usage: Usage, operation: Callable[[], None], count: int, sample_cpu: bool = False,
           **extra: float) -> Dict[str, Any]:
    """Run ``operation`` ``count`` times as one phase of ``usage``; besides the phase's totals,
    each operation's wall time (``walls``) and, with ``sample_cpu``, its process and calling
    thread CPU (``cpus``, ``caller_cpus``). Reading every thread's counter costs CPU itself:
    ``sampler_cpu`` is what a sample of doing nothing reads (the median of 50), to take off.

    >>> phase = repeat(Usage(), lambda: sum(range(1000)), 3, sample_cpu=True)
    >>> phase["ops"], len(phase["walls"]), len(phase["cpus"]), phase["sampler_cpu"] >= 0
    (3, 3, 3, True)
    """
    walls: List[float] = []
    cpus: List[float] = []
    callers: List[float] = []
    phase_extra: Dict[str, Any] = {}
    if sample_cpu:
        phase_extra["sampler_cpu"] = statistics.median(_sampled(lambda: None, usage.caller)[1] for _ in range(50))
    usage.start()
    for _ in range(count):
        if sample_cpu:
            wall, cpu, caller = _sampled(operation, usage.caller)
            cpus.append(cpu)
            callers.append(caller)
        else:
            begin = time.perf_counter()
            operation()
            wall = time.perf_counter() - begin
        walls.append(round(wall, 7))
    phase: Dict[str, Any] = usage.stop(ops=count, **extra)
    phase["walls"] = walls
    if sample_cpu:
        phase["cpus"], phase["caller_cpus"] = cpus, callers
        phase.update(phase_extra)
    return phase
