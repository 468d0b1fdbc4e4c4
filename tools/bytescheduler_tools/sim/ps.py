"""MXNet's parameter server (ps-lite, ``dist_sync``) in simulated time, plain and scheduled.

What MXNet 1.9.1 does, read in its source (github.com/apache/mxnet, tag 1.9.1):

* ``python/mxnet/gluon/trainer.py``, ``_allreduce_grads``: with ``update_on_kvstore`` every
  step calls ``kvstore.pushpull(i, grad, out=weight, priority=-i)`` for each parameter, right
  after ``backward()`` returns; MXNet's engine runs each call once its gradient is computed.
* ``src/kvstore/kvstore_dist.h``: ``PushPullDefault`` sends one push-and-pull request per key
  (``ZPushPull``); ``EncodeDefaultKey`` puts a key of fewer than
  ``MXNET_KVSTORE_BIGARRAY_BOUND`` (1,000,000) elements whole on server ``(key * 9973) %
  servers`` and splits a larger one evenly over every server; the reply is copied into the
  weights (``comm_->Broadcast``, on the engine).
* ``src/kvstore/kvstore_dist_server.h``, ``DataHandleDefault`` and ``ApplyUpdates``: in
  ``dist_sync`` a server adds each worker's push of a key; once every worker's has arrived it
  runs the optimizer on the key (on its main thread) and answers every worker's request with
  the new value.

Model: every worker computes alike, so a key's pushes reach its server together. Each
piece of a key on a server (a *part*) is sent on the worker's connection to that server (in
order), then, once every worker's copy arrived, the server spends its CPU (sum, update,
reply) on its thread, then replies on its connection back (in order); a call is done when
every part's reply arrived. Links: each machine has an uplink and a downlink of the
network's rate. With servers on the workers' machines (``Network.servers == 0``: one per
rank, as ``bytescheduler bench`` runs them), a part on server ``s`` crosses the links of the
other W-1 workers; the simulation puts those W-1 copies on one representative sender, the
machine after ``s``, so that each link carries its share of all the traffic and a part
alone takes what its server's link needs: exact for 2 ranks. With servers of their own,
every worker's uplink carries one copy and the server's downlink W. The servers' CPU runs
on the core of the machine it lives on; with a calibration, the simulated rank's threads
stand for every rank's: on another machine's core they take the share they take on their
own (a shadow that never slows them), and that machine's server gets the rest.

Systems:

* ``ps``: gluon + ``dist_sync``: every parameter's push-pull when its gradient is computed,
  MXNet's key layout; each layer's next forward waits for its own weights.
* ``ps-scheduled``: ScheduledKVStore: keys larger than the grain (the partition size) are
  sub-keys of that size (``bytescheduler/mxnet/keys.py``), each a server key of its own;
  rank 0's real policy (4 MiB pieces of whole sub-keys, a 64 MiB credit, no merging, one
  lane) decides which go when; ``overlap(net)`` lets each block's forward wait for its own
  pulls. Its framework path (``adaptive``) is the inner store's calls with the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from bytescheduler.core.config import SchedulerConfig
from bytescheduler.core.partition import partition_ranges
from bytescheduler.core.task import Operation
from .calibration import BackendCosts, Calibration
from .events import Phase, Simulation, Thread, Wait, Work
from .fluid import CORE
from .network import Network
from .profile import Profile
from .scheduling import PolicyDriver, ScheduledCommunication
from .training import Communication, Gradient, StepMode, Training, gradients

BIGARRAY_BOUND = 1_000_000  # MXNET_KVSTORE_BIGARRAY_BOUND's default (elements)
SERVER_HASH = 9973  # EncodeDefaultKey: a small key lives on server (key * 9973) % servers
SUBKEY_BASE = 100_000  # bytescheduler/mxnet/keys.py: the first sub-key of a partitioned tensor
ITEMSIZE = 4  # float32 gradients

Done = Callable[[float], None]


@dataclass(frozen=True)
class ServerKey:
    """One key on the servers: its number and the bytes of it each server holds."""

    key: int
    parts: Tuple[Tuple[int, int], ...]  # (server, bytes)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.parts)


def server_key(key: int, nbytes: int, servers: int) -> ServerKey:
    """Where MXNet's ``EncodeDefaultKey`` puts ``key``'s ``nbytes``.

    >>> server_key(3, 400, 2).parts, server_key(3, 8_000_000, 2).parts
    (((1, 400),), ((0, 4000000), (1, 4000000)))
    """
    elements = nbytes // ITEMSIZE
    if elements < BIGARRAY_BOUND:
        return ServerKey(key, (((key * SERVER_HASH) % servers, nbytes),))
    bounds = [round(elements / servers * i) for i in range(servers + 1)]
    return ServerKey(key, tuple((i, (bounds[i + 1] - bounds[i]) * ITEMSIZE) for i in range(servers)))


def mxnet_layout(grads: List[Gradient], servers: int) -> Dict[int, List[ServerKey]]:
    """MXNet's own layout: one key per parameter (gluon's index)."""
    return {g.key: [server_key(g.key, g.nbytes, servers)] for g in grads}


def grain_layout(grads: List[Gradient], servers: int, grain_bytes: int) -> Dict[int, List[ServerKey]]:
    """ScheduledKVStore's layout (``mxnet/keys.py``): a parameter larger than ``grain_bytes``
    becomes sub-keys of that size, numbered from :data:`SUBKEY_BASE` as parameters are
    initialised (in index order); each sub-key is a server key of its own."""
    layout: Dict[int, List[ServerKey]] = {}
    next_subkey = SUBKEY_BASE
    for grad in grads:
        ranges = partition_ranges(grad.nbytes // ITEMSIZE, ITEMSIZE, grain_bytes) or [(0, 0)]
        if len(ranges) == 1:
            layout[grad.key] = [server_key(grad.key, grad.nbytes, servers)]
            continue
        layout[grad.key] = [server_key(next_subkey + j, (stop - start) * ITEMSIZE, servers)
                            for j, (start, stop) in enumerate(ranges)]
        next_subkey += len(ranges)
    return layout


class Servers:
    """The parameter servers, the workers' connections to them, and every machine's links."""

    def __init__(self, sim: Simulation, network: Network, workers: int, calibration: Optional[Calibration],
                 update_seconds_per_byte: float) -> None:
        self.sim = sim
        self.network = network
        self.workers = workers
        self.colocated = network.servers == 0
        self.count = workers if self.colocated else network.servers
        self.costs: Optional[BackendCosts] = calibration.backend("ps-lite") if calibration is not None else None
        self.update_seconds_per_byte = update_seconds_per_byte
        self.calls = 0
        self._send = [Thread(sim, f"push to server {s}") for s in range(self.count)]
        self._reply = [Thread(sim, f"reply from server {s}") for s in range(self.count)]
        self._serve = [Thread(sim, f"server {s}", mirrored=False) for s in range(self.count)]

    def machine_core(self, server: int) -> str:
        """The core a server's thread runs on."""
        if self.colocated:
            return CORE if server == 0 else f"{CORE}@{server}"
        return f"{CORE}@server{server}"

    def capacities(self, cores: float) -> Dict[str, float]:
        """Every resource: the machines' links (capacity 1: seconds per second) and cores."""
        caps: Dict[str, float] = {}
        machines = [f"{m}" for m in range(self.workers)]
        if not self.colocated:
            machines += [f"server{s}" for s in range(self.count)]
        for machine in machines:
            caps[f"up@{machine}"] = 1.0
            caps[f"down@{machine}"] = 1.0
        for server in range(self.count):
            caps[self.machine_core(server)] = cores
        caps.setdefault(CORE, cores)
        return caps

    def mirror_cores(self) -> Tuple[str, ...]:
        """The other workers' cores, which the simulated training thread stands for (colocated)."""
        return tuple(self.machine_core(s) for s in range(1, self.count)) if self.colocated else ()

    def _links(self, server: int, nbytes: int, push: bool) -> Dict[str, float]:
        """Link seconds per part: the representative senders' and the server's link."""
        rate = self.network.bandwidth
        if self.colocated:
            copies = self.workers - 1
            worker, host = f"{(server + 1) % self.workers}", f"{server}"
            per_link = copies * nbytes / rate
            worker_load = host_load = per_link
        else:
            worker, host = "0", f"server{server}"
            worker_load, host_load = nbytes / rate, self.workers * nbytes / rate
        if push:
            return {f"up@{worker}": worker_load, f"down@{host}": host_load}
        return {f"up@{host}": host_load, f"down@{worker}": worker_load}

    def _worker_cpu(self, nbytes: int) -> float:
        return (self.costs.cpu_per_op + self.costs.cpu_per_byte * nbytes) if self.costs else 0.0

    def _server_cpu(self, nbytes: int) -> float:
        if self.costs is None:
            return self.update_seconds_per_byte * nbytes
        return self.costs.server_cpu_per_op + self.costs.server_cpu_per_byte * nbytes * self.workers

    def pushpull(self, keys: List[ServerKey], done: Done) -> None:
        """One worker call: push every part of ``keys``, ``done(now)`` once every reply arrived."""
        self.calls += 1
        parts = [(server, size) for key in keys for server, size in key.parts]
        left = [len(parts)]

        def replied(now: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                done(now)

        for server, size in parts:
            self._part(server, size, replied)
        if not parts:
            self.sim.at(self.sim.now, done)

    def _part(self, server: int, size: int, replied: Done) -> None:
        push = self._links(server, size, push=True)
        reply = self._links(server, size, push=False)
        half_cpu = self._worker_cpu(size) / 2  # sending, and receiving the reply
        fixed = max(0.0, self.costs.op_seconds - self.costs.cpu_per_op) / 2 if self.costs else self.network.latency
        core = self.machine_core(server)

        def pushed(now: float) -> None:
            self._serve[server].run([Work("serve", self._server_cpu(size), {core: 1.0}, "server")],
                                    lambda t: self._reply[server].run(
                                        _transfer("reply", reply, half_cpu, fixed), replied))

        self._send[server].run(_transfer("push", push, half_cpu, fixed), pushed)


def _transfer(name: str, links: Dict[str, float], cpu_seconds: float, fixed: float) -> List[Phase]:
    """A message's phases: its fixed wait, then its bytes over ``links`` with ``cpu_seconds``."""
    demand = dict(links)
    demand[CORE] = cpu_seconds
    phases: List[Phase] = []
    if fixed > 0:
        phases.append(Wait("latency", fixed, name))
    phases.append(Work(name, 1.0, demand, name))
    return phases


class PlainStore(Communication):
    """gluon's Trainer over ``dist_sync``: each parameter's push-pull once its gradient is computed."""

    def __init__(self, servers: Servers, layout: Dict[int, List[ServerKey]]) -> None:
        self.servers = servers
        self.layout = layout

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        self.servers.pushpull(self.layout[grad.key], lambda t, grad=grad: self.training.communicated([grad], t))
        return 0.0

    @property
    def operations(self) -> int:
        return self.servers.calls


class ScheduledStore(ScheduledCommunication):
    """ScheduledKVStore: every parameter through the real policy, pieces of whole sub-keys."""

    def __init__(self, sim: Simulation, servers: Servers, layout: Dict[int, List[ServerKey]],
                 config: SchedulerConfig) -> None:
        self.servers = servers
        self.layout = layout
        costs = servers.costs
        self.driver = PolicyDriver(sim, config.with_options(merge=False), 1, self._launch, self._done,
                                   cpu_per_op=costs.ours_cpu_per_op if costs else 0.0)

    def gradient_ready(self, grad: Gradient, now: float) -> float:
        keys = self.layout[grad.key]
        # One element per sub-key, of the first's size (the store's credit counts a short last one whole).
        self.driver.submit(grad, grad.key, len(keys) * keys[0].nbytes, grad.key, numel=len(keys),
                           itemsize=keys[0].nbytes)
        return 0.0

    def _launch(self, op: Operation, finished: Done) -> None:
        keys = [key for piece in op.pieces for key in self.layout[piece.task.payload.key][piece.start:piece.stop]]
        self.servers.pushpull(keys, finished)


def build(sim: Simulation, profile: Profile, network: Network, ranks: int, system: str, config: SchedulerConfig,
          calibration: Optional[Calibration]) -> Training:
    """The training thread of ``ps``, ``ps-scheduled`` or the latter's framework path."""
    grads = gradients(profile)
    update = profile.step_s / (profile.gradient_bytes or 1)  # the servers' optimizer, without a calibration
    servers = Servers(sim, network, ranks, calibration, update)
    sim.fluid.capacities.update(servers.capacities(float(calibration.cores) if calibration else float("inf")))
    sim.mirror_cores = servers.mirror_cores() if calibration is not None else ()
    copy = calibration.memcpy_seconds if calibration is not None else (lambda nbytes: 0.0)
    if system == "ps":
        comm: Communication = PlainStore(servers, mxnet_layout(grads, servers.count))
    else:
        layout = grain_layout(grads, servers.count, config.partition_bytes)
        if system == "ps-scheduled":
            comm = ScheduledStore(sim, servers, layout, config)
        else:  # its framework path: the inner store's calls, same layout
            comm = PlainStore(servers, layout)
    return Training(sim, profile, StepMode.SERVER, comm, copy_seconds=copy)
