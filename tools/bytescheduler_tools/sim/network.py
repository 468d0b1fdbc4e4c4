"""The network as the simulator sees it: one link per rank, and what an all-reduce costs.

>>> link = Network(bandwidth=125e6, latency=0.0)          # 1 Gbit/s, no latency
>>> round(link.allreduce_seconds(125_000_000, ranks=2), 3)  # 2(n-1)/n of the bytes each way
1.0
>>> round(link.allreduce_seconds(125_000_000, ranks=4), 3)
1.5
>>> parse_rate("none")  # loopback: no link limit (the CPU limits, with a calibration)
inf
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
UNLIMITED = ("none", "loopback")


def parse_rate(text: str) -> float:
    """Bytes per second of a rate written as ``tc`` writes it (``1gbit``, ``500mbit``, ``25gbit``);
    ``none`` (or ``loopback``) is an unlimited link, as ``bytescheduler bench --bandwidth none``."""
    cleaned = text.strip().lower()
    if cleaned in UNLIMITED:
        return math.inf
    match = _RATE.match(cleaned)
    if not match:
        raise ValueError(f"bandwidth {text!r} is not a rate: use e.g. 1gbit, 500mbit, 25gbit, or none")
    return float(match.group(1)) * _UNITS[match.group(2)] / 8


@dataclass(frozen=True)
class Network:
    """Each rank's link and the fixed costs of one operation.

    bandwidth: bytes per second each rank sends (and receives) at once; ``math.inf`` for
        no limit (loopback).
    latency: seconds per message step of the algorithm.
    op_seconds: fixed cost of one operation in the backend (launch, negotiation, its CPU);
        a calibration's measured costs replace it (see :mod:`bytescheduler_tools.sim.calibration`).
    algorithm: ``ring`` (2(n-1) steps, each rank sends 2(n-1)/n of the bytes) or ``tree``
        (reduce and broadcast over a binary tree, pipelined: 2 log2(n) steps, 2x the bytes).
    servers: parameter servers (the ``ps`` systems): 0 puts one on each rank's machine, as
        MXNet jobs often run and ``bytescheduler bench`` runs them; a positive number gives
        that many servers on machines of their own, each with a link like the ranks'.
    """

    bandwidth: float
    latency: float = 50e-6
    op_seconds: float = 0.0
    algorithm: str = "ring"
    servers: int = 0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, not {self.bandwidth}")
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"algorithm must be 'ring' or 'tree', not {self.algorithm!r}")
        if self.servers < 0:
            raise ValueError(f"servers must be 0 (one on each rank's machine) or positive, not {self.servers}")

    def steps(self, ranks: int) -> int:
        """Message steps of one all-reduce on ``ranks`` ranks."""
        if ranks <= 1:
            return 0
        return 2 * (ranks - 1) if self.algorithm == "ring" else 2 * math.ceil(math.log2(ranks))

    def volume(self, nbytes: float, ranks: int) -> float:
        """Bytes each rank sends (and receives) in one all-reduce of ``nbytes``."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes if self.algorithm == "ring" else 2.0 * nbytes

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds the link needs to send ``nbytes`` at full rate (0 on an unlimited link)."""
        return nbytes / self.bandwidth

    def allreduce_seconds(self, nbytes: int, ranks: int) -> float:
        """Seconds one all-reduce of ``nbytes`` takes on ``ranks`` ranks, the link otherwise idle."""
        if ranks <= 1:
            return self.op_seconds
        return self.op_seconds + self.steps(ranks) * self.latency + self.transfer_seconds(self.volume(nbytes, ranks))
