"""A 2-rank training job of one adapter on 127.0.0.1, for the soak and chaos tools.

Framework-free: it starts processes and watches them, so it runs in either environment.

- ``optimizer``, ``hook``: two :mod:`~bytescheduler_tools.bench.torch_trainee` ranks joined by
  torch.distributed (gloo, ``tcp://127.0.0.1:<free port>``); ``ddp`` the same with plain DDP,
  no bytescheduler (a reference);
- ``horovod``: Horovod's rendezvous server (:mod:`~bytescheduler_tools.bench.rendezvous`, a
  helper that serves until it is stopped) and two ranks with the ``HOROVOD_*`` variables
  ``horovodrun -np 2 -H localhost:2 --gloo`` would give them, but without horovodrun, so that
  a rank's death is seen by the other rank and not ended by horovodrun's kill-all;
- ``mxnet``: ``python -m bytescheduler.launcher -n 2 -s 1`` (``bytescheduler mxnet-launch``)
  running two :mod:`~bytescheduler_tools.bench.mxnet_trainee` workers, with the MXNet interpreter.

Every process is started in a session of its own and carries ``BYTESCHEDULER_JOB_MARKER=<a
fresh id>`` in its environment, which its children inherit: that is how :meth:`Job.pids`
finds all of a job's processes (the launcher's nodes too) and nothing else. Every job has a
deadline; :meth:`Job.kill` ends whatever of it is left (its process groups, then every marked
process). :meth:`Job.poll` also notes every TCP port a process of the job listens on.

>>> job = Job("optimizer", ["--steps", "200"], "/tmp/job", deadline=300)   # doctest: +SKIP
>>> job.start(); job.wait(); job.kill()                                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set

from bytescheduler.launcher import free_port
from .procstats import alive, kill_all, listening_ports, marked_pids, still_listening

ADAPTERS = ("optimizer", "hook", "horovod", "mxnet")
# Plain DDP without bytescheduler: what the framework alone does, to compare with.
REFERENCES = ("ddp",)
MARKER = "BYTESCHEDULER_JOB_MARKER"
WORLD = 2
HOST = "127.0.0.1"
POLL_SECONDS = 0.25
# Settings of the caller's that would break the job's own launch (a launcher's, a role's).
_STRIPPED = ("HOROVOD_", "DMLC_", MARKER)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit(143)`` in the main thread, so that the ``finally``
    blocks that kill the jobs run (by default SIGTERM ends the process and leaves them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_until_closed(ports: Set[int], seconds: float = 3.0) -> Set[int]:
    """Those of ``ports`` still listening after up to ``seconds`` (the kernel closes a dead
    process's sockets at once; a listener that stays belongs to a process still running)."""
    end = time.time() + seconds
    while still_listening(ports) and time.time() < end:
        time.sleep(0.1)
    return still_listening(ports)


def default_mxnet_python() -> Optional[str]:
    """An interpreter with MXNet: ``$BYTESCHEDULER_MXNET_PYTHON``, else this one when it has
    MXNet, else the checkout's ``.venv-mxnet/bin/python`` when it exists."""
    if os.environ.get("BYTESCHEDULER_MXNET_PYTHON"):
        return os.environ["BYTESCHEDULER_MXNET_PYTHON"]
    if importlib.util.find_spec("mxnet") is not None:
        return sys.executable
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
    local = os.path.join(checkout, ".venv-mxnet", "bin", "python")
    return local if os.path.exists(local) else None


def horovod_env(rank: int, rendezvous_port: int) -> Dict[str, str]:
    """What ``horovodrun -np 2 -H localhost:2 --gloo`` gives rank ``rank`` (one host, two slots)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": HOST, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo",
        "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(WORLD),
        "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(WORLD),
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
    }


@dataclass
class Process:
    """One process the job started; a ``helper`` serves the others until it is stopped."""

    name: str
    popen: subprocess.Popen
    helper: bool = False
    exited_at: Optional[float] = None  # time.time() when poll() first saw it gone


class Job:
    """One adapter's 2-rank job. ``trainee_options`` are :mod:`~bytescheduler_tools.bench.rank_loop`'s,
    without ``--report`` (each rank writes ``<job_dir>/rank<R>.jsonl``).

    Args:
        adapter: one of :data:`ADAPTERS`.
        job_dir: created if missing; the reports and one log per process go there.
        deadline: seconds from :meth:`start` after which :meth:`poll` says so.
        python: the interpreter (for ``mxnet``, one with MXNet).
        env: added to every process's environment.
    """

    def __init__(self, adapter: str, trainee_options: List[str], job_dir: str, deadline: float,
                 python: str = sys.executable, env: Optional[Dict[str, str]] = None) -> None:
        if adapter not in ADAPTERS + REFERENCES:
            raise ValueError(f"unknown adapter {adapter!r}: use one of {', '.join(ADAPTERS + REFERENCES)}")
        self.adapter, self.job_dir, self.deadline, self.python = adapter, job_dir, deadline, python
        self.options = list(trainee_options) + ["--report", os.path.join(job_dir, "rank{rank}.jsonl")]
        self.marker = uuid.uuid4().hex
        self.env = {key: value for key, value in os.environ.items() if not key.startswith(_STRIPPED)}
        self.env.update(env or {})
        self.env.update({MARKER: self.marker, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        self.processes: List[Process] = []
        self.ports: Set[int] = set()  # every port a process of the job was seen listening on
        self.started = self.ends = 0.0
        self.killed: List[str] = []  # what kill() found still running
        self._logs = []
        os.makedirs(job_dir, exist_ok=True)

    def report_path(self, rank: int) -> str:
        return os.path.join(self.job_dir, f"rank{rank}.jsonl")

    # --- starting ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: List[str], env: Optional[Dict[str, str]] = None, helper: bool = False) -> None:
        log = open(os.path.join(self.job_dir, f"{name}.log"), "w")
        self._logs.append(log)
        popen = subprocess.Popen(argv, env=dict(self.env, **(env or {})), stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(Process(name, popen, helper))

    def start(self) -> None:
        """Start every process of the job (for Horovod, once the rendezvous server is up)."""
        self.started = time.time()
        self.ends = self.started + self.deadline
        trainee = [self.python, "-m"]
        if self.adapter in ("optimizer", "hook", "ddp"):
            port = free_port()
            for rank in range(WORLD):
                self._spawn(f"rank{rank}", trainee + ["bytescheduler_tools.bench.torch_trainee", "--adapter", self.adapter,
                                                      "--rank", str(rank), "--world-size", str(WORLD),
                                                      "--port", str(port)] + self.options)
        elif self.adapter == "horovod":
            port_file = os.path.join(self.job_dir, "rendezvous.port")
            self._spawn("rendezvous", trainee + ["bytescheduler_tools.bench.rendezvous", "--hosts", f"localhost:{WORLD}",
                                                 "--size", str(WORLD), "--port-file", port_file], helper=True)
            port = self._await_port(port_file)
            for rank in range(WORLD):
                self._spawn(f"rank{rank}", trainee + ["bytescheduler_tools.bench.torch_trainee", "--adapter", "horovod"]
                            + self.options, env=horovod_env(rank, port))
        else:
            worker = trainee + ["bytescheduler_tools.bench.mxnet_trainee"] + self.options
            self._spawn("launcher", trainee + ["bytescheduler.launcher", "-n", str(WORLD), "-s", "1",
                                               "--deadline", f"{self.deadline:g}", "--"] + worker)

    def _await_port(self, path: str) -> int:
        while not os.path.exists(path):
            if time.time() > self.ends or self.processes[-1].popen.poll() is not None:
                raise RuntimeError(f"Horovod's rendezvous server did not start; see {self.job_dir}/rendezvous.log")
            time.sleep(0.05)
        with open(path) as handle:
            return int(handle.read())

    # --- watching ---------------------------------------------------------------------------
    def pids(self) -> List[int]:
        """Every live process of the job (started by it or by its processes)."""
        return marked_pids(MARKER, self.marker)

    def poll(self) -> None:
        """Note exits and listening ports; call it every :data:`POLL_SECONDS`."""
        now = time.time()
        for process in self.processes:
            if process.exited_at is None and process.popen.poll() is not None:
                process.exited_at = now
        self.ports |= listening_ports(self.pids())

    def finished(self) -> bool:
        """Every process but the helpers has exited."""
        return all(process.exited_at is not None for process in self.processes if not process.helper)

    def overdue(self) -> bool:
        return time.time() > self.ends

    def wait(self) -> bool:
        """Poll until :meth:`finished` (True) or the deadline (False)."""
        while True:
            self.poll()
            if self.finished():
                return True
            if self.overdue():
                return False
            time.sleep(POLL_SECONDS)

    def exit_codes(self) -> Dict[str, Optional[int]]:
        return {process.name: process.popen.returncode for process in self.processes}

    def keep_logs(self, folder: str) -> str:
        """Copy the job's folder (logs and reports) into ``folder``; where it went."""
        target = os.path.join(folder, os.path.basename(self.job_dir))
        shutil.copytree(self.job_dir, target, dirs_exist_ok=True)
        return target

    def signal(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to ``pid`` if it is a live process of this job; True when sent."""
        if pid not in self.pids():
            return False
        kill_all([pid], sig)
        return True

    # --- ending -----------------------------------------------------------------------------
    def kill(self) -> List[str]:
        """SIGKILL whatever of the job is left; the names (or pids) of what was still running."""
        running = [process for process in self.processes if process.popen.poll() is None]
        found = [process.name for process in running]
        for process in running:  # not reaped: the group is certainly ours
            try:
                os.killpg(process.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in self.processes:
            try:
                process.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        strays = self.pids()  # also those in sessions of their own, whose leader has gone
        if strays and running:  # members of the groups just killed may take a moment to die
            time.sleep(0.2)
            strays = self.pids()
        found += [f"pid {pid}" for pid in strays]
        kill_all(strays)
        end = time.time() + 10
        while any(alive(pid) for pid in strays) and time.time() < end:
            time.sleep(0.05)
        for log in self._logs:
            log.close()
        self._logs = []
        self.killed += found
        return found

