"""What communication costs on a machine: per backend, measured by ``bytescheduler calibrate``.

:func:`derive` turns the ranks' reports of a probe (:mod:`~bytescheduler_tools.sim.probe_torch`,
:mod:`~bytescheduler_tools.sim.probe_mxnet`) into a backend's :class:`BackendCosts`.

A :class:`Calibration` holds, for each backend (``gloo``, ``horovod``, ``ps-lite``), the
fixed wall time of one small operation, the CPU one operation and one byte cost the rank's
core (every thread of the rank's processes and the kernel's network work on that core), and
the rate a large operation achieved; and for the machine, the memory-copy rate of one
thread. The simulator's CPU model (:mod:`bytescheduler_tools.sim.engine`) takes these from the
calibration: without one, communication costs no CPU and every thread has a core of its
own (the first step's model).

>>> costs = Calibration({"gloo": BackendCosts(op_seconds=2e-4, cpu_per_op=1e-4, cpu_per_byte=1e-9)}, 4e9)
>>> Calibration.from_json(costs.to_json()) == costs, costs.backend("gloo").cpu_per_byte
(True, 1e-09)
>>> Calibration.from_json(costs.to_json()).backend("horovod")
Traceback (most recent call last):
...
ValueError: the calibration has no 'horovod' costs (it has gloo): run `bytescheduler calibrate --backends horovod` and pass its file
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from statistics import mean
from typing import Any, Dict, List

BACKENDS = ("gloo", "horovod", "ps-lite")


@dataclass(frozen=True)
class BackendCosts:
    """One backend's costs, measured between 2 ranks (all in seconds and bytes).

    op_seconds: wall time of one small operation, alone (its fixed cost).
    cpu_per_op: CPU-seconds one operation costs the rank's core, beyond its bytes.
    cpu_per_byte: CPU-seconds per byte of the tensor (2 ranks; the simulator scales it with
        the bytes each rank sends for more ranks).
    rate: bytes per second of tensor a large operation achieved (what the calibration saw;
        the simulator takes the link rate from ``--bandwidth``).
    idle_cpu_per_s: CPU-seconds per second the backend burns with nothing to do (Horovod's
        background thread negotiates every cycle).
    ours_cpu_per_op: CPU-seconds bytescheduler's dispatcher spends per operation over this
        backend, beyond the backend's own.
    ours_cpu_per_poll: CPU-seconds of one wake-up of bytescheduler's Horovod completion
        poller (a poll and a short sleep).
    hook_cpu: CPU-seconds the framework's own data-parallel wrapper spends on the training
        thread per gradient in backward (DDP's reducer, Horovod's hook), beyond its copies.
    ours_hook_cpu: the same for ScheduledOptimizer's gradient hook (beyond its division).
    server_cpu_per_op, server_cpu_per_byte: a parameter server's CPU per key and per byte
        of each worker's push (sum, update, reply), on the core the server runs on.
    """

    op_seconds: float = 0.0
    cpu_per_op: float = 0.0
    cpu_per_byte: float = 0.0
    rate: float = 0.0
    idle_cpu_per_s: float = 0.0
    ours_cpu_per_op: float = 0.0
    ours_cpu_per_poll: float = 0.0
    hook_cpu: float = 0.0
    ours_hook_cpu: float = 0.0
    server_cpu_per_op: float = 0.0
    server_cpu_per_byte: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """Per-backend costs and the machine's copy rate; ``cores``: CPU cores per rank (1 when
    every rank was pinned to a core of its own, as ``bytescheduler bench`` runs them)."""

    backends: Dict[str, BackendCosts]
    memcpy_bytes_per_s: float = 0.0
    cores: int = 1
    network: str = ""  # where it was measured (loopback, or the shaped testbed's rate)
    busy_elsewhere: float = 0.0  # share of the ranks' CPUs other processes used meanwhile
    raw: Dict[str, Any] = field(default_factory=dict, compare=False)  # every rank's report, per backend

    def backend(self, name: str) -> BackendCosts:
        """The costs of ``name``; a clear error when the calibration did not measure it."""
        if name not in self.backends:
            raise ValueError(f"the calibration has no {name!r} costs (it has {', '.join(self.backends) or 'none'}): "
                             f"run `bytescheduler calibrate --backends {name}` and pass its file")
        return self.backends[name]

    def memcpy_seconds(self, nbytes: float) -> float:
        """CPU-seconds one thread needs to copy ``nbytes`` (0 without a measured rate)."""
        return nbytes / self.memcpy_bytes_per_s if self.memcpy_bytes_per_s > 0 else 0.0

    def to_json(self) -> str:
        data = asdict(self)
        raw = data.pop("raw")
        text = json.dumps(data, indent=1)  # the costs readable, every rank's report on one line
        return f'{text[:-2]},\n "raw": {json.dumps(raw)}\n}}\n'


    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        known = {f.name for f in fields(BackendCosts)}
        backends = {name: BackendCosts(**{k: float(v) for k, v in costs.items() if k in known})
                    for name, costs in data.get("backends", {}).items()}
        return cls(backends, float(data.get("memcpy_bytes_per_s", 0.0)), int(data.get("cores", 1)),
                   str(data.get("network", "")), float(data.get("busy_elsewhere", 0.0)), dict(data.get("raw", {})))

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """Read a calibration file, with an error that says how to make one."""
        try:
            with open(path) as handle:
                return cls.from_json(handle.read())
        except FileNotFoundError:
            raise ValueError(f"no calibration file {path!r}: make one with `bytescheduler calibrate --out {path}`") from None
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path!r} is not a calibration written by `bytescheduler calibrate` ({error})") from None


def _cpu(phase: Dict[str, float], spins: bool = False) -> float:
    """CPU a rank spent in a phase: its process's threads (their system time includes the
    kernel's sending and receiving); ``spins``: without the calling thread, which only
    waited (Horovod's ``synchronize`` polls, yielding the core to any thread that wants it).
    The interrupt work on the core is recorded but left out: on a shared machine it counts
    other people's traffic too, and on the quiet bench machine it was a few ms per iteration
    (``rest of the core`` in docs/bench)."""
    return phase["process_cpu"] - (phase.get("caller_cpu", 0.0) if spins else 0.0)


def low(samples: List[float], share: float = 0.1) -> float:
    """The ``share`` quantile of ``samples`` (the least contended of them).

    >>> low([5.0, 1.0, 2.0, 3.0, 4.0, 9.0, 6.0, 7.0, 8.0, 10.0])
    1.0
    """
    ordered = sorted(samples)
    return ordered[int(share * (len(ordered) - 1))]


def derive(backend: str, reports: List[dict]) -> BackendCosts:
    """One backend's costs from its ranks' reports (means over the ranks).

    Per rank: the idle phase gives the CPU burnt with nothing to do (per second); the small
    operations give the fixed cost (their wall time) and the CPU per operation (their
    phase's CPU, less the idle burn meanwhile); the large ones, each less the CPU per
    operation, the CPU per byte and the rate. Of the single operations the least contended
    ones count (the 10% quantile of the small ones' walls, the cheapest and the fastest
    large one): other work on a shared machine only ever adds, and the CPU model adds the
    contention it models itself.
    Horovod's back-to-back small operations take one cycle when negotiation and the
    all-reduce fit in it, so its fixed cost is what they took beyond the cycle; its
    background thread does not turn idle while it runs a large operation, so nothing idle
    is taken off those. ps-lite's servers (one on each rank's core) are measured apart, per
    operation and per byte of each worker's push.

    >>> phase = lambda s, cpu, **kw: dict(seconds=s, process_cpu=cpu, interrupt_cpu=0.5, **kw)
    >>> rank = {"idle": phase(1.0, 0.0), "small": phase(0.1, 0.05, ops=500, walls=[2e-4] * 500),
    ...         "large": phase(1.0, 0.15, ops=4, bytes=25_000_000, walls=[0.25] * 4, cpus=[0.0375] * 4),
    ...         "ours": {"operations": 0}}
    >>> costs = derive("gloo", [rank, rank])
    >>> costs.op_seconds, costs.cpu_per_op, round(costs.cpu_per_byte * 1e9, 3), costs.rate
    (0.0002, 0.0001, 1.496, 100000000.0)
    """
    op_seconds, cpu_op, cpu_byte, rates, idle, ours, polls, server_op, server_byte, hooks, our_hooks = (
        [] for _ in range(11))
    spins = backend == "horovod"
    for report in reports:
        burn = _cpu(report["idle"], spins) / report["idle"]["seconds"]
        small, large = report["small"], report["large"]
        # A thread's CPU counter moves in steps (at switches and ticks): read over a whole phase.
        per_op = max(0.0, (_cpu(small, spins) - burn * small["seconds"]) / small["ops"])
        wall = low(small["walls"])
        if backend == "horovod":
            wall = max(0.0, wall - report.get("cycle_seconds", 1e-3))
        callers = large.get("caller_cpus", [0.0] * large["ops"]) if spins else [0.0] * large["ops"]
        reading = large.get("sampler_cpu", 0.0)
        per_byte = min(
            max(0.0, cpu - caller - reading - (0.0 if spins else burn * seconds) - per_op) / large["bytes"]
            for cpu, caller, seconds in zip(large["cpus"], callers, large["walls"]))
        if backend == "ps-lite":
            moved = large["ops"] * large["bytes"]
            server_burn = report["idle"].get("peer_cpu", 0.0) / report["idle"]["seconds"]
            server_op.append(max(0.0, small.get("peer_cpu", 0.0) - server_burn * small["seconds"]) / small["ops"])
            server_byte.append(max(0.0, large.get("peer_cpu", 0.0) - server_burn * large["seconds"]) / moved)
        op_seconds.append(wall)
        cpu_op.append(per_op)
        cpu_byte.append(per_byte)
        rates.append(large["bytes"] / min(large["walls"]))
        idle.append(burn)
        done = report.get("ours", {})
        if done.get("operations"):
            ours.append(done["dispatch_cpu"] / done["operations"])
        if "poll_cpu" in report:
            polls.append(report["poll_cpu"])
        if "hooks" in report:
            hook = report["hooks"]
            copy = hook["bytes"] / report["memcpy_bytes_per_s"]
            # DDP copies every gradient into its bucket and back (gloo); Horovod copies none
            # in the hook. ScheduledOptimizer over gloo divides each gradient (one pass).
            copies, our_copies = (2, 1) if backend == "gloo" else (0, 0)
            plain = hook["plain_backward_cpu"]
            hooks.append(max(0.0, hook["framework_backward_cpu"] - plain - copies * copy) / hook["gradients"])
            if done.get("backward_cpu"):
                our_hooks.append(max(0.0, done["backward_cpu"] - plain - our_copies * copy) / hook["gradients"])
    workers = len(reports)
    return BackendCosts(
        op_seconds=mean(op_seconds), cpu_per_op=mean(cpu_op), cpu_per_byte=mean(cpu_byte), rate=mean(rates),
        idle_cpu_per_s=mean(idle), ours_cpu_per_op=mean(ours) if ours else 0.0,
        ours_cpu_per_poll=mean(polls) if polls else 0.0,
        hook_cpu=mean(hooks) if hooks else 0.0, ours_hook_cpu=mean(our_hooks) if our_hooks else 0.0,
        # A small key lives on one server: the servers' CPU per operation is the sum over ranks.
        server_cpu_per_op=sum(server_op) if server_op else 0.0,
        # Every server's CPU, per byte of each worker's push (the key is split over all servers).
        server_cpu_per_byte=sum(server_byte) / workers if server_byte else 0.0)


def busy_elsewhere(raw: Dict[str, List[dict]]) -> float:
    """The share of the ranks' pinned CPUs other processes used while the ranks idled.

    >>> idle = {"seconds": 1.0, "core_cpu": 0.3, "process_cpu": 0.05, "peer_cpu": 0.05}
    >>> busy_elsewhere({"gloo": [{"idle": idle}, {"idle": idle}]})
    0.2
    """
    shares = [max(0.0, r["idle"].get("core_cpu", 0.0) - r["idle"]["process_cpu"] - r["idle"].get("peer_cpu", 0.0))
              / r["idle"]["seconds"] for reports in raw.values() for r in reports]
    return round(mean(shares), 6) if shares else 0.0
