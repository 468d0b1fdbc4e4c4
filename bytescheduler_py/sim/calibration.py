"""What communication costs on a machine: per backend, measured by ``bytescheduler calibrate``.

A :class:`Calibration` holds, for each backend (``gloo``, ``horovod``, ``ps-lite``), the
fixed wall time of one small operation, the CPU one operation and one byte cost the rank's
core (every thread of the rank's processes and the kernel's network work on that core), and
the rate a large operation achieved; and for the machine, the memory-copy rate of one
thread. The simulator's CPU model (:mod:`bytescheduler.sim.engine`) takes these from the
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
from typing import Any, Dict

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

