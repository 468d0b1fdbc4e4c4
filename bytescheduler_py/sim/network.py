"""The network as the simulator sees it: one link per rank, and what an all-reduce costs.

>>> link = Network(bandwidth=125e6, latency=0.0)          # 1 Gbit/s, no latency
>>> round(link.allreduce_seconds(125_000_000, ranks=2), 3)  # 2(n-1)/n of the bytes each way
1.0
>>> round(link.allreduce_seconds(125_000_000, ranks=4), 3)
1.5
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """Bytes per second of a rate written as ``tc`` writes it (``1gbit``, ``500mbit``, ``25gbit``)."""
    match = _RATE.match(text.strip().lower())
    if not match:
        raise ValueError(f"bandwidth {text!r} is not a rate: use e.g. 1gbit, 500mbit, 25gbit")
    return float(match.group(1)) * _UNITS[match.group(2)] / 8


@dataclass(frozen=True)
class Network:
    """Each rank's link and the fixed costs of one operation.

    bandwidth: bytes per second each rank sends (and receives) at once.
    latency: seconds per message step of the algorithm.
    op_seconds: fixed cost of one operation in the backend (launch, negotiation, its CPU).
    algorithm: ``ring`` (2(n-1) steps, each rank sends 2(n-1)/n of the bytes) or ``tree``
        (reduce and broadcast over a binary tree, pipelined: 2 log2(n) steps, 2x the bytes).
    """

    bandwidth: float
    latency: float = 50e-6
    op_seconds: float = 0.0
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive, not {self.bandwidth}")
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"algorithm must be 'ring' or 'tree', not {self.algorithm!r}")

    def allreduce_seconds(self, nbytes: int, ranks: int) -> float:
        """Seconds one all-reduce of ``nbytes`` takes on ``ranks`` ranks, the link otherwise idle."""
        if ranks <= 1:
            return self.op_seconds
        if self.algorithm == "ring":
            steps, volume = 2 * (ranks - 1), 2 * (ranks - 1) / ranks * nbytes
        else:
            steps, volume = 2 * math.ceil(math.log2(ranks)), 2.0 * nbytes
        return self.op_seconds + steps * self.latency + volume / self.bandwidth
