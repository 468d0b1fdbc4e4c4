"""A bandwidth-limited network on one machine: network namespaces joined by rate-shaped veth pairs.

A hub namespace holds a bridge; each rank gets a namespace joined to the hub by a veth
pair, with a ``tbf`` rate limit on both ends (uplink and downlink). Ranks talk over
10.99.0.0/24 (rank i is 10.99.0.(i+1)), so no traffic leaves the machine. Needs root
and iproute2; :func:`make_testbed` falls back to plain loopback (and says so) otherwise.

>>> with make_testbed(2, "1gbit") as net:                  # doctest: +SKIP
...     command = net.wrap(0, ["python", "train.py"])    # runs inside rank 0's namespace
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from typing import Dict, List, Optional

_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")


class Testbed:
    """Where the ranks run and how to reach rank 0; a context manager that tears itself down."""

    description = "plain loopback (127.0.0.1): no rate limit"
    master_addr = "127.0.0.1"
    # One CPU per rank (see :func:`pin_cores`): every process of rank i runs on cores[i],
    # as if each rank had a machine of its own; None runs unpinned.
    cores: Optional[List[int]] = None

    def wrap(self, rank: int, command: List[str]) -> List[str]:
        return self.pinned(rank, command)

    def pinned(self, rank: int, command: List[str]) -> List[str]:
        if self.cores:
            return ["taskset", "-c", str(self.cores[rank % len(self.cores)]), *command]
        return command

    def env(self, rank: int) -> Dict[str, str]:
        return {"HOROVOD_GLOO_IFACE": "lo"}

    def address(self, rank: int) -> str:
        """The address rank ``rank`` binds (e.g. a parameter server's ``DMLC_NODE_HOST``)."""
        return "127.0.0.1"

    def hostname(self, rank: int) -> str:
        """The machine rank ``rank`` is on, as Horovod names it (ranks on one machine share it)."""
        return "localhost"

    def close(self) -> None:
        pass

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NamespaceTestbed(Testbed):
    """``ranks`` namespaces in a star, each link shaped to ``rate`` (e.g. ``"1gbit"``) both ways."""

    def __init__(self, ranks: int, rate: str) -> None:
        if not _RATE.match(rate):
            raise ValueError(f"bandwidth {rate!r} is not a tc rate: use e.g. 1gbit, 500mbit, or none")
        self.rate = rate
        tag = uuid.uuid4().hex[:6]  # several testbeds (or a crashed one) never collide
        self.hub = f"bshub{tag}"
        self.names = [f"bsr{tag}{i}" for i in range(ranks)]
        self.master_addr = "10.99.0.1"
        self.description = f"{ranks} network namespaces, veth links shaped to {rate} each way (tbf)"
        self._made: List[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    def _tc(self, *args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=30)

    def _build(self) -> None:
        self._ip("netns", "add", self.hub)
        self._made.append(self.hub)
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        shape = ["root", "tbf", "rate", self.rate, "burst", "1mb", "limit", "8mb"]
        for rank, name in enumerate(self.names):
            self._ip("netns", "add", name)
            self._made.append(name)
            port = f"p{rank}"
            self._ip("link", "add", "v0", "netns", name, "type", "veth", "peer", "name", port, "netns", self.hub)
            self._ip("-n", self.hub, "link", "set", port, "master", "br0")
            self._ip("-n", self.hub, "link", "set", port, "up")
            self._ip("-n", name, "addr", "add", f"{self.address(rank)}/24", "dev", "v0")
            self._ip("-n", name, "link", "set", "v0", "up")
            self._ip("-n", name, "link", "set", "lo", "up")
            self._tc("-n", name, "qdisc", "replace", "dev", "v0", *shape)  # uplink
            self._tc("-n", self.hub, "qdisc", "replace", "dev", port, *shape)  # downlink

    def wrap(self, rank: int, command: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.names[rank], *self.pinned(rank, command)]

    def env(self, rank: int) -> Dict[str, str]:
        # gloo (torch's and Horovod's) and ps-lite bind this interface (else they may pick
        # 127.0.0.1 and cannot reach the others).
        return {"GLOO_SOCKET_IFNAME": "v0", "HOROVOD_GLOO_IFACE": "v0", "DMLC_INTERFACE": "v0"}

    def address(self, rank: int) -> str:
        return f"10.99.0.{rank + 1}"

    def hostname(self, rank: int) -> str:
        return self.names[rank]  # one machine per namespace

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()


def namespaces_available() -> Optional[str]:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def pin_cores(ranks: int) -> Optional[List[int]]:
    """A CPU for each rank, or None when there are fewer CPUs than ranks or no ``taskset``.

    Pinned, the ranks of a 2-core machine do not steal each other's core: each behaves
    like a machine of its own with one core, which is what the benchmark models.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks or shutil.which("taskset") is None:
        return None
    return cpus[:ranks]


def make_testbed(ranks: int, bandwidth: str) -> Testbed:
    """A namespace testbed shaped to ``bandwidth``, or loopback for ``"none"`` or when impossible."""
    if bandwidth in ("none", "", None):
        return Testbed()
    reason = namespaces_available()
    if reason is None:
        try:
            return NamespaceTestbed(ranks, bandwidth)
        except subprocess.CalledProcessError as error:
            reason = f"{' '.join(error.cmd)} failed: {error.stderr.strip()}"
    fallback = Testbed()
    fallback.description = f"plain loopback (127.0.0.1), NOT rate-limited: namespaces unavailable ({reason})"
    return fallback
