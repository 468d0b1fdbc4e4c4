"""What every benchmark worker shares, whatever its framework; imports none (MXNet's runs without torch).

A worker builds its systems (objects with ``iterate``, ``flush``, ``stats`` and ``close``),
then :func:`run_blocks` warms each up and times alternating blocks, and
:func:`write_result` writes the per-rank JSON the runner merges and the report reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

# A large all-reduce (or push+pull) measures the link: bytes each rank sends per second.
LINK_MEGABYTES = 32


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pinned_cpu() -> Optional[int]:
    """The one CPU this process may run on, or None when it may run on several."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    return next(iter(cpus)) if len(cpus) == 1 else None


def cpu_busy_seconds(cpu: int) -> float:
    """Seconds CPU ``cpu`` has spent on anything but idling since boot (``/proc/stat``).

    Counts user, system, interrupt and soft-interrupt time, so the kernel's network work
    done on the rank's core (TCP, shaping) is included, whichever process it is charged to.
    """
    prefix = f"cpu{cpu} "
    with open("/proc/stat") as handle:
        for line in handle:
            if line.startswith(prefix):
                user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in line.split()[1:8])
                return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    raise OSError(f"no line for CPU {cpu} in /proc/stat")


# Whose CPU time a thread's is, in the CPU breakdown (see :func:`thread_roles`).
ROLES = ("training thread", "bytescheduler threads", "other Python threads", "native threads")


def thread_cpu_seconds() -> Dict[int, float]:
    """Seconds each live thread of this process has run on a CPU, by native thread id.

    From ``/proc/self/task/*/schedstat`` (nanoseconds); threads that end while being read
    are left out.
    """
    seconds: Dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as handle:
                seconds[int(tid)] = int(handle.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return seconds


def thread_roles() -> Dict[int, Tuple[str, str]]:
    """The role (one of :data:`ROLES`) and name of every thread Python knows, by native id.

    Threads Python did not start (gloo's, Horovod's background thread, MXNet's engine and
    ps-lite's) are not listed: they count as native threads. Names lose their rank suffix.
    """
    main = threading.main_thread()
    roles = {}
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        role = ROLES[0] if thread is main else ROLES[1] if thread.name.startswith("bytescheduler") else ROLES[2]
        roles[thread.native_id] = (role, re.sub(r"-r\d+$", "", thread.name) if role == ROLES[1] else role)
    return roles


class CpuMeter:
    """CPU seconds per thread role over timed blocks, and the core's busy time outside this process."""

    def __init__(self, cpu: Optional[int]) -> None:
        self.cpu = cpu
        self.totals: Dict[str, Dict[str, float]] = {}  # system -> role -> seconds
        self.threads: Dict[str, Dict[str, float]] = {}  # system -> bytescheduler thread name -> seconds
        self.iterations: Dict[str, int] = {}
        self._start: Dict[int, float] = {}
        self._core_start = 0.0

    def start(self) -> None:
        self._start = thread_cpu_seconds()
        self._core_start = cpu_busy_seconds(self.cpu) if self.cpu is not None else 0.0

    def stop(self, system: str, iterations: int) -> None:
        end = thread_cpu_seconds()
        core = cpu_busy_seconds(self.cpu) - self._core_start if self.cpu is not None else None
        roles = thread_roles()
        totals = self.totals.setdefault(system, dict.fromkeys(ROLES + ("rest of the core",), 0.0))
        threads = self.threads.setdefault(system, {})
        process = 0.0
        for tid, seconds in end.items():
            spent = seconds - self._start.get(tid, 0.0)
            role, name = roles.get(tid, (ROLES[3], ROLES[3]))
            totals[role] += spent
            if role == ROLES[1]:
                threads[name] = threads.get(name, 0.0) + spent
            process += spent
        if core is not None:  # the kernel's network work, other processes (MXNet's server) on the core
            totals["rest of the core"] += max(0.0, core - process)
        self.iterations[system] = self.iterations.get(system, 0) + iterations

    def per_iteration_ms(self, by_thread: bool = False) -> Dict[str, Dict[str, float]]:
        """Milliseconds per iteration by role, or (``by_thread``) by bytescheduler thread."""
        table = self.threads if by_thread else self.totals
        return {system: {role: round(1000 * seconds / self.iterations[system], 3) for role, seconds in roles.items()}
                for system, roles in table.items()}


# Warm-up steps at most while the adaptive switch makes its first choice.
MAX_CHOOSING_STEPS = 500


def _counts(system: "System") -> Tuple[int, int]:
    stats = system.stats() or {}
    return stats.get("operations", 0), stats.get("pieces", 0)


class Tracer:
    """Compute spans (forward, backward, step) of the traced iteration, as Chrome trace events."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: List[dict] = []
        self.active = False
        self._offset = time.time() - time.perf_counter()

    def span(self, system: str, name: str, start: float, end: float) -> None:
        """Record a span if the current iteration is traced (``active``)."""
        if self.active:
            self.record(system, name, start, end)

    def record(self, system: str, name: str, start: float, end: float) -> None:
        """Record a span (``time.perf_counter()`` seconds), traced or not (for spans learned later)."""
        self.record_wall(system, name, (start + self._offset) * 1e6, (end + self._offset) * 1e6)

    def record_wall(self, system: str, name: str, start_us: float, end_us: float) -> None:
        """Record a span given in wall-clock microseconds (as Chrome traces and MXNet's profiler count)."""
        self.events.append({"name": name, "cat": f"compute:{system}", "ph": "X", "pid": self.rank, "tid": 1,
                            "ts": round(start_us, 3), "dur": round(end_us - start_us, 3)})


class System:
    """A way to train, as :func:`run_blocks` drives it: ``iterate`` runs one training iteration,
    ``flush`` waits for its pending communication, ``stats`` are the scheduler's counters."""

    name: str
    tuned = False  # auto-tuned during warm-up (``--auto-tune``)

    def iterate(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def trace(self, active: bool) -> None:
        """Record the scheduler's timeline only while the traced round runs."""

    def stats(self) -> dict:
        return {}

    def mode_switch(self) -> Optional[object]:
        """The adaptive mode switch (anything with a ``chooser``), or None."""
        return None

    def choosing(self) -> bool:
        """True until the adaptive mode switch made its first choice (the same step on every rank)."""
        switch = self.mode_switch()
        return switch is not None and switch.chooser.choices == 0 and not switch.chooser.fixed

    def modes(self) -> str:
        """The mode of every step so far, one letter each (s: scheduled, p: plain), or ''."""
        switch = self.mode_switch()
        return "" if switch is None else "".join(mode[0] for mode in switch.chooser.history)

    def steady_steps(self) -> Optional[int]:
        """Steps from now on that surely keep the mode switch's mode (None: no switch, or it
        stopped choosing, so every step runs alike; the same on every rank)."""
        switch = self.mode_switch()
        return None if switch is None else switch.chooser.steady_steps

    def mode_verdicts(self) -> List[dict]:
        """Rank 0: the mode switch's choices and the step times behind each (else [])."""
        switch = self.mode_switch()
        return [] if switch is None else list(switch.chooser.verdicts)

    def close(self) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every worker takes (the runner passes them through)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--systems", nargs="+", required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--lead-in", type=int, default=0,
                        help="untimed iterations at the start of each block (see run_blocks)")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--from-start", action="store_true",
                        help="do not extend the warm-up until the mode switch has chosen (see run_blocks)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--credit", default=None)
    parser.add_argument("--auto-tune", type=int, default=0, metavar="STEPS",
                        help="tune the scheduled systems' partition and credit during STEPS extra warm-up steps")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--no-trace", action="store_true", help="do not trace the last round's compute")
    parser.add_argument("--no-link", action="store_true", help="do not measure the link")
    parser.add_argument("--output", required=True, help="result file; {rank} is replaced by the rank")


def link_rate(allreduce: Callable[[], None], barrier: Callable[[], None], world: int, repeats: int = 3) -> float:
    """Bytes per second each rank sends in ``allreduce()`` of :data:`LINK_MEGABYTES` (best of ``repeats``)."""
    allreduce()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        allreduce()
        times.append(time.perf_counter() - start)
    return 2 * (world - 1) / world * LINK_MEGABYTES * 2**20 / min(times)


def record_timeline(scheduler: object, active: bool) -> None:
    """Let ``scheduler``'s timeline (if it has one) record only while ``active`` (the traced round)."""
    timeline = getattr(scheduler, "timeline", None)
    if timeline is not None:
        timeline.recording = active


def touch(path: str) -> None:
    """Create the empty file ``path`` (the turns' signals between the runner and the jobs)."""
    with open(path, "w"):
        pass


class Turns:
    """Blocks taken in turns with other jobs on the same machine (the MXNet systems, which need
    a job each): the job's ``k``-th turn starts when the runner creates ``go-k`` in ``directory``;
    each rank writes ``done-k.rank<r>`` when the turn is over. Before its first turn each rank
    writes ``ready.rank<r>``. Turn 0 is the warm-up (with the mode switch's first trials), then
    one turn per timed block. Without a directory every turn starts at once.
    """

    def __init__(self, directory: Optional[str], rank: int, poll_s: float = 0.01) -> None:
        self.directory, self.rank, self.poll_s = directory, rank, poll_s
        self.turn = 0
        self._mark("ready")

    def _mark(self, name: str) -> None:
        if self.directory is not None:
            touch(os.path.join(self.directory, f"{name}.rank{self.rank}"))

    def begin(self) -> None:
        """Wait for this job's next turn (idle: a check every ``poll_s``)."""
        if self.directory is None:
            return
        go = os.path.join(self.directory, f"go-{self.turn}")
        while not os.path.exists(go):
            time.sleep(self.poll_s)

    def end(self) -> None:
        self._mark(f"done-{self.turn}")
        self.turn += 1


def round_order(names: List[str], round_index: int) -> List[str]:
    """The systems' order in a round: as given in even rounds, reversed in odd ones (A B, B A,
    A B...), so that no system always runs right after another one."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def trace_block(round_index: int, rounds: int, iters: int, steady: Optional[int], traced_before: bool) -> bool:
    """Whether to trace a system's block of round ``round_index`` (``steady``:
    :meth:`System.steady_steps` before the block; ``traced_before``: an earlier block of the
    system was traced, which only happens to one that kept one mode throughout).

    The last round is traced, as the timelines show the run's end, unless its block will
    switch modes (a re-trial) and a block that kept one mode was traced already: with
    6 rounds of 10 iterations, the second look at a first choice (50 steps on) lands in the
    last block, whose timeline then showed the re-trial of the framework's own path instead of
    the chosen schedule. So an earlier block is traced too when
    it is the last that fits in the current hold; the charts draw the last block traced.
    """
    if round_index == rounds - 1:
        return steady is None or steady >= iters or not traced_before
    return steady is not None and iters <= steady < 2 * iters  # the last block that fits in the hold


def run_blocks(systems: Dict[str, System], args: argparse.Namespace, barrier: Callable[[], None], tracer: Tracer,
               rank: int, turns: Optional[Turns] = None
               ) -> Tuple[Dict[str, List[float]], Dict[str, float], Dict[str, List[float]], Dict[str, dict]]:
    """Warm every system up, then ``args.rounds`` rounds of one timed block per system, in turns.

    A barrier starts each block; the system's flush (waiting for its pending communication)
    ends it inside the timed block: a block runs from rest to rest, which charges a system
    that overlaps one iteration's sending with the next forward (ScheduledOptimizer) one
    forward and one backward per block in which nothing can be sent yet (about 0.1 s per
    block on the VGG-like model at 1 Gbit/s). With ``args.lead_in``, the block measures the
    steady state instead: that many untimed iterations first, then the timer runs from the
    end of the last of them to the end of the last timed ``iterate()``, and the flush comes
    after it, untimed. Both ends of the timed span are then at the same point of the
    iteration, with the same work in flight, so the span is ``args.iters`` whole periods of a
    training that does not stop (the same as from rest for a system that waits for its
    communication inside each iteration, as DDP does).
    The systems' order alternates (:func:`round_order`).
    With ``turns``, the warm-up and every block wait for the job's turn (:class:`Turns`).
    The last round is traced unless ``args.no_trace`` (:func:`trace_block`: with a mode switch,
    rather the last block that keeps one mode throughout).
    Returns seconds per iteration per block, peak RSS (MiB) per system, when this process
    is pinned to one CPU the fraction of each block that CPU was busy (1.0: the rank's core
    was the limit; empty lists when not pinned), and a profile per system: CPU milliseconds
    per iteration by thread role, operations and pieces per iteration.
    """
    turns = turns or Turns(None, rank)
    turns.begin()
    for system in systems.values():
        # Tuning happens in warm-up, the same number of steps on every rank.
        for _ in range(args.warmup + (args.auto_tune if system.tuned else 0)):
            system.iterate()
        # The adaptive switch's first trials too (a few dozen steps, once per training run);
        # its later re-trials fall in the timed blocks. With --from-start they are timed.
        for _ in range(0 if getattr(args, "from_start", False) else MAX_CHOOSING_STEPS):
            if not system.choosing():
                break
            system.iterate()
        system.flush()
    turns.end()
    times: Dict[str, List[float]] = {name: [] for name in systems}
    rss: Dict[str, float] = {name: 0.0 for name in systems}
    busy: Dict[str, List[float]] = {name: [] for name in systems}
    cpu = pinned_cpu()
    meter = CpuMeter(cpu)
    counted = {name: [0, 0] for name in systems}  # operations, pieces in timed blocks
    plain_steps = {name: 0 for name in systems}
    spans: Dict[str, List[Tuple[float, float]]] = {name: [] for name in systems}  # wall-clock, per block
    traced = {name: False for name in systems}  # an earlier block was traced (one that kept one mode)
    progress(rank, 0, args.rounds)
    for round_index in range(args.rounds):
        for name in round_order(list(systems), round_index):
            system = systems[name]
            turns.begin()
            tracer.active = not args.no_trace and trace_block(round_index, args.rounds, args.lead_in + args.iters,
                                                              system.steady_steps(), traced[name])
            traced[name] = traced[name] or tracer.active
            system.trace(tracer.active)
            barrier()
            for _ in range(args.lead_in):
                system.iterate()
            ops, pieces = _counts(system)
            steps_before = len(system.modes())
            busy_start = cpu_busy_seconds(cpu) if cpu is not None else 0.0
            meter.start()
            wall, start = time.time(), time.perf_counter()
            for _ in range(args.iters):
                system.iterate()
            if not args.lead_in:
                system.flush()
            elapsed = time.perf_counter() - start
            busy_end = cpu_busy_seconds(cpu) if cpu is not None else 0.0
            spans[name].append((wall, wall + elapsed))
            meter.stop(name, args.iters)
            if args.lead_in:
                system.flush()
            ops_end, pieces_end = _counts(system)
            counted[name][0] += ops_end - ops
            counted[name][1] += pieces_end - pieces
            plain_steps[name] += system.modes()[steps_before:].count("p")
            times[name].append(elapsed / args.iters)
            if cpu is not None:
                busy[name].append(min(1.0, (busy_end - busy_start) / elapsed))
            tracer.active = False
            system.trace(False)
            rss[name] = max(rss[name], rss_mib())
            turns.end()
        progress(rank, round_index + 1, args.rounds)
    cpu_ms, thread_ms = meter.per_iteration_ms(), meter.per_iteration_ms(by_thread=True)
    profile = {name: {"cpu_ms_per_iteration": cpu_ms.get(name, {}),
                      "bytescheduler_thread_ms_per_iteration": thread_ms.get(name, {}),
                      "operations_per_iteration": counted[name][0] / max(1, meter.iterations.get(name, 0)),
                      "pieces_per_iteration": counted[name][1] / max(1, meter.iterations.get(name, 0)),
                      "plain_fraction": (plain_steps[name] / max(1, meter.iterations.get(name, 0))
                                         if systems[name].modes() else None),
                      "mode_verdicts": systems[name].mode_verdicts(),
                      "block_spans": spans[name]}
               for name in systems}
    return times, rss, busy, profile


def write_result(args: argparse.Namespace, rank: int, systems: Dict[str, System], times: Dict[str, List[float]],
                 rss: Dict[str, float], busy: Dict[str, List[float]], link: float, gradient_bytes: int,
                 tracer: Tracer, profile: Optional[Dict[str, dict]] = None) -> None:
    """The per-rank JSON every job writes (``link`` is 0.0 when not measured)."""
    result = {
        "rank": rank,
        "times": times,
        "rss_mib": rss,
        "core_busy": busy,
        "profile": profile or {},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "link_bytes_per_s": link,
        "gradient_bytes": gradient_bytes,
        "stats": {name: system.stats() for name, system in systems.items()},
        "compute_events": tracer.events,
    }
    with open(args.output.replace("{rank}", str(rank)), "w") as handle:
        json.dump(result, handle)


def progress(rank: int, done: int, total: int) -> None:
    if rank == 0:
        print(f"PROGRESS {done}/{total}", flush=True)
