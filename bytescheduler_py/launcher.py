"""Start an MXNet parameter-server job (ps-lite, e.g. ``dist_sync``) on this machine.

    bytescheduler mxnet-launch -n 2 -s 1 [--deadline SECONDS] -- python train.py args...
    python -m bytescheduler.launcher -n 2 -s 1 ...     (the same)

One scheduler, ``-s`` servers and ``-n`` workers run as separate processes on 127.0.0.1, each in
its own session (process group). The scheduler and the servers are ``python -c "import mxnet"``:
importing MXNet with ``DMLC_ROLE=scheduler|server`` runs that role and exits when the workers
have finished. The workers run the given command. Every process gets::

    DMLC_ROLE              scheduler | server | worker
    DMLC_PS_ROOT_URI       127.0.0.1
    DMLC_PS_ROOT_PORT      a free port
    DMLC_NUM_SERVER        -s
    DMLC_NUM_WORKER        -n
    DMLC_NODE_HOST         127.0.0.1 (without it ps-lite binds the address of eth0)
    BYTESCHEDULER_LAUNCH_ID     the same random id for every process of one launch
    BYTESCHEDULER_LAUNCH_INDEX  the process's index within its role
    MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD  1, unless set (see :data:`ENGINE_ENV`)

The index is only the launch order: a worker's rank (``kv.rank``) is assigned by the scheduler.

Output lines are prefixed with role and index (``[worker 1] ...``). ps-lite has no failure
detection: when one process dies the others wait forever. So the launcher stops the whole job
(SIGTERM to every process group it started, SIGKILL after a grace period) as soon as any process
exits non-zero, when the deadline passes, or on Ctrl-C / SIGTERM, and says why on stderr. A
worker that exits 0 while others still train is no failure by itself (it may just be first to
finish); when the job then fails, the launcher names it.

Exit status: 0 when every worker exited 0; the exit code of the process that failed first
(128 + N for a signal N) when any failed; 124 when the deadline passed; 127 when a process
cannot be started; 130 on Ctrl-C (143 on SIGTERM).

A worker that fails in Python does not exit by itself: once it has created a ``dist_*`` store,
the interpreter's exit (an uncaught exception, ``sys.exit(3)``, even a normal return) runs the
store's destructor, which waits in ps-lite's finalize barrier for every other node, and the
others are waiting for the failed worker. Only the deadline would end such a job. Workers should
run their main function through :func:`run_worker`, which ends the process at once with
``os._exit`` when it raises (``sys.exit(code)`` included), so the launcher sees the failure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, List, NoReturn, Optional, Sequence

# MXNet's engine settings every process of a launch gets (no MXNet import).
from .mxnet.engine_env import ENGINE_ENV, ENGINE_KEYS, engine_hint, with_engine_env  # noqa: F401

PROG = "bytescheduler mxnet-launch"
HOST = "127.0.0.1"
EXIT_DEADLINE = 124
EXIT_CANNOT_START = 127
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
POLL_SECONDS = 0.05


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _Terminated(BaseException):
    """Raised in the main thread when the launcher itself receives SIGTERM."""


@dataclass
class _Node:
    role: str
    index: int
    popen: subprocess.Popen
    reader: Optional[threading.Thread] = field(default=None)
    waiter: Optional[threading.Thread] = field(default=None)
    # When the launcher saw the process end (time.monotonic()); orders failures, so that the
    # one that failed first, usually the cause of the others, gives the job's exit status.
    exited_at: Optional[float] = field(default=None)

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def pgid(self) -> int:
        # start_new_session=True: the child is the leader of its own session and process group.
        return self.popen.pid


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        return f"was killed by {signame}"
    return f"exited with code {code}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _status_of(code: int) -> int:
    return 128 - code if code < 0 else code


class Launcher:
    """One parameter-server job; :func:`launch` is the usual entry point.

    ``nodes`` lists every process started (role, index, ``Popen``; each is the leader of its
    own process group), ``port`` the scheduler's port and ``launch_id`` the value of
    ``BYTESCHEDULER_LAUNCH_ID`` in their environments.
    """

    def __init__(
        self,
        command: Sequence[str],
        num_workers: int,
        num_servers: int,
        deadline: Optional[float] = None,
        env: Optional[Dict[str, str]] = None,
        *,
        shutdown_timeout: float = 30.0,
        grace: float = 5.0,
        output: Optional[IO[str]] = None,
        messages: Optional[IO[str]] = None,
    ) -> None:
        if not command:
            raise ValueError("no worker command given")
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, not {num_workers}")
        if num_servers < 1:
            raise ValueError(f"num_servers must be at least 1, not {num_servers}")
        if deadline is not None and deadline <= 0:
            raise ValueError(f"deadline must be positive, not {deadline}")
        self.command = list(command)
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.deadline = deadline
        self.env = dict(env or {})
        self.shutdown_timeout = shutdown_timeout
        self.grace = grace
        self._output = output
        self._messages = messages
        self._print_lock = threading.Lock()
        self.nodes: List[_Node] = []
        self.port: Optional[int] = None
        self.launch_id = uuid.uuid4().hex
        self._exited = threading.Event()  # set whenever a process ends: the job loop looks at once

    # --- output ---------------------------------------------------------------------------
    @property
    def output(self) -> IO[str]:
        return self._output if self._output is not None else sys.stdout

    @property
    def messages(self) -> IO[str]:
        return self._messages if self._messages is not None else sys.stderr

    def say(self, text: str) -> None:
        with self._print_lock:
            print(f"{PROG}: {text}", file=self.messages, flush=True)

    def _pump(self, node: _Node) -> None:
        prefix = f"[{node.name}] "
        stream = node.popen.stdout
        assert stream is not None
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._print_lock:
                    try:
                        self.output.write(prefix + line + "\n")
                        self.output.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout is gone (closed pipe); keep draining the child
        finally:
            stream.close()

    # --- processes ------------------------------------------------------------------------
    def _node_env(self, role: str, index: int) -> Dict[str, str]:
        env = with_engine_env(dict(os.environ, **self.env))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(
            DMLC_ROLE=role,
            DMLC_PS_ROOT_URI=HOST,
            DMLC_PS_ROOT_PORT=str(self.port),
            DMLC_NUM_SERVER=str(self.num_servers),
            DMLC_NUM_WORKER=str(self.num_workers),
            DMLC_NODE_HOST=HOST,
            BYTESCHEDULER_LAUNCH_ID=self.launch_id,
            BYTESCHEDULER_LAUNCH_INDEX=str(index),
        )
        return env

    def _start(self, role: str, index: int, argv: List[str]) -> None:
        popen = subprocess.Popen(
            argv,
            env=self._node_env(role, index),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        node = _Node(role, index, popen)
        self.nodes.append(node)
        node.reader = threading.Thread(target=self._pump, args=(node,), name=f"mxnet-launch {node.name}")
        node.reader.start()
        node.waiter = threading.Thread(target=self._watch, args=(node,), name=f"mxnet-launch wait {node.name}",
                                       daemon=True)
        node.waiter.start()

    def _watch(self, node: _Node) -> None:
        # A thread per process notes when it ends. Polling all of them every POLL_SECONDS could
        # not tell which of two deaths came first: a worker that fails because its peer died
        # usually follows within milliseconds.
        node.popen.wait()
        node.exited_at = time.monotonic()
        self._exited.set()

    def _pause(self) -> None:
        """Sleep until a process ends, or POLL_SECONDS at most."""
        self._exited.wait(POLL_SECONDS)
        self._exited.clear()

    def _start_all(self) -> None:
        self.port = free_port()
        role_argv = [sys.executable, "-c", "import mxnet"]
        self._start("scheduler", 0, role_argv)
        for index in range(self.num_servers):
            self._start("server", index, role_argv)
        for index in range(self.num_workers):
            self._start("worker", index, self.command)
        started = ", ".join(f"{node.name} (pid {node.popen.pid})" for node in self.nodes)
        self.say(f"{HOST}:{self.port}: started {started}")

    def _group_alive(self, node: _Node) -> bool:
        node.popen.poll()  # reap the leader, so that a finished one is not counted as a zombie
        try:
            os.killpg(node.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # the id now belongs to someone else's group: ours is gone
        return True

    def _signal_groups(self, sig: int) -> None:
        for node in self.nodes:
            if self._group_alive(node):
                try:
                    os.killpg(node.pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop_all(self) -> None:
        """SIGTERM every process group started, SIGKILL what is left after the grace period."""
        try:
            self._signal_groups(signal.SIGTERM)
            end = time.monotonic() + self.grace
            while time.monotonic() < end and any(self._group_alive(node) for node in self.nodes):
                time.sleep(POLL_SECONDS)
        except (KeyboardInterrupt, _Terminated):
            pass  # a second Ctrl-C: no more grace
        finally:
            left = [node for node in self.nodes if self._group_alive(node)]
            if left:
                self.say("killing " + ", ".join(node.name for node in left) + " (SIGKILL)")
            self._signal_groups(signal.SIGKILL)
            self._reap(5.0)

    def _reap(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for node in self.nodes:
            try:
                node.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            for thread in (node.reader, node.waiter):
                if thread is not None:
                    thread.join(timeout=max(0.5, end - time.monotonic()))

    # --- the job --------------------------------------------------------------------------
    def _failures(self) -> List[_Node]:
        """The processes that exited non-zero, the first to exit first."""
        failed = [node for node in self.nodes if node.popen.poll() not in (None, 0)]
        for node in failed:
            if node.waiter is not None:
                node.waiter.join()  # returncode is set: the thread is about to note the time
        return sorted(failed, key=lambda node: node.exited_at or 0.0)

    def _report_failures(self, failed: List[_Node], training: bool = False) -> int:
        for node in failed:
            self.say(f"{node.name} (pid {node.popen.pid}) {_describe_exit(node.popen.returncode)}")
        if training:
            # A worker that leaves early with status 0 is no failure by itself, but the others
            # then wait for it until they fail (e.g. a communication timeout): name it.
            left = [node for node in self.nodes if node.role == "worker" and node.popen.returncode == 0]
            if left:
                self.say(", ".join(f"{node.name} (pid {node.popen.pid})" for node in left)
                         + " had already exited with code 0, before the other workers finished")
        others = [node for node in self.nodes if node.popen.returncode is None]
        if others:
            self.say("stopping " + ", ".join(node.name for node in others))
        return _status_of(failed[0].popen.returncode)

    def run(self) -> int:
        start = time.monotonic()
        end = None if self.deadline is None else start + self.deadline
        stopped = False
        try:
            try:
                self._start_all()
            except OSError as exc:  # e.g. the worker command does not exist
                self.say(f"cannot start the job: {exc}")
                self.stop_all()
                stopped = True
                return EXIT_CANNOT_START
            workers = [node for node in self.nodes if node.role == "worker"]
            # Phase 1: until every worker has exited 0, any failure stops the job.
            while True:
                failed = self._failures()
                if failed:
                    status = self._report_failures(failed, training=True)
                    self.stop_all()
                    stopped = True
                    return status
                if all(node.popen.returncode == 0 for node in workers):
                    break
                if end is not None and time.monotonic() >= end:
                    running = [node.name for node in self.nodes if node.popen.returncode is None]
                    self.say(f"deadline of {self.deadline:g} s passed; stopping " + ", ".join(running))
                    self.stop_all()
                    stopped = True
                    return EXIT_DEADLINE
                self._pause()
            # Phase 2: the workers are done; the scheduler and the servers should follow.
            wait = self.shutdown_timeout
            if end is not None:
                wait = min(wait, max(0.0, end - time.monotonic()))
            wait_end = time.monotonic() + wait
            while time.monotonic() < wait_end and any(node.popen.poll() is None for node in self.nodes):
                self._pause()
            failed = self._failures()
            left = [node.name for node in self.nodes if node.popen.returncode is None]
            if left:
                self.say(f"all workers finished, but {', '.join(left)} did not exit within "
                         f"{wait:g} s; stopping them")
            if failed or left:
                self.stop_all()
            else:
                self._reap(5.0)
            stopped = True
            if failed:
                return self._report_failures(failed)
            self.say(f"all {_plural(len(workers), 'worker')} finished in {time.monotonic() - start:.1f} s")
            return 0
        except KeyboardInterrupt:
            self.say("interrupted; stopping every process")
            self.stop_all()
            stopped = True
            return EXIT_INTERRUPTED
        except _Terminated:
            self.say("terminated; stopping every process")
            self.stop_all()
            stopped = True
            return EXIT_TERMINATED
        finally:
            if not stopped:  # an unexpected error in the launcher itself: leave nothing behind
                self.stop_all()


def launch(
    command: List[str],
    num_workers: int,
    num_servers: int,
    deadline: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
    **options,
) -> int:
    """Run ``command`` as ``num_workers`` workers with ``num_servers`` servers; return the status.

    ``deadline`` is in seconds from the start (None: no deadline); ``env`` is added to every
    process's environment. Keyword ``options`` go to :class:`Launcher` (``shutdown_timeout``,
    ``grace``, ``output``, ``messages``).
    """
    return Launcher(command, num_workers, num_servers, deadline, env, **options).run()


def run_worker(fn: Callable[..., Any], *args: Any) -> NoReturn:
    """Run a worker's ``fn(*args)``; when it raises, end the process at once.

    An exception from ``fn`` (``sys.exit(3)`` inside ``fn`` included) is printed (a non-zero
    ``SystemExit`` only when its code is not a number) and the process ends with ``os._exit``
    while the exception, and so ``fn``'s frame with its ``KVStore``, is still referenced: were the
    store freed first, its destructor would wait in ps-lite's finalize barrier for nodes that
    are waiting for this one. When ``fn`` returns, the process exits normally (status 0, or the
    returned int), through MXNet's clean shutdown together with the other nodes.

    So report failure by raising (or ``sys.exit(code)``) inside ``fn``, not by returning a
    status: when ``fn`` returns, a store held in its local variables has already been freed,
    and the destructor has already waited.
    """
    held: Optional[BaseException] = None
    try:
        status = fn(*args)
    except SystemExit as exc:
        held = exc
        status = exc.code
    except BaseException as exc:  # noqa: BLE001 - any failure must end the process
        held = exc
        traceback.print_exc()
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    if held is None or status == 0:
        del held
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)  # ``held`` keeps the failed frame (and its store) alive until here


def _parse_env(items: List[str]) -> Dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env wants KEY=VALUE, not {item!r}")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run an MXNet parameter-server job (one scheduler, S servers, N workers) "
        "on 127.0.0.1. Any process failing, the deadline or Ctrl-C stops the whole job.",
        epilog="example: bytescheduler mxnet-launch -n 2 -s 1 --deadline 300 -- python train.py --epochs 1",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--num-servers", type=int, default=1, help="number of servers (default: 1)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="stop the job after this many seconds (default: none)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds the scheduler and servers get to exit after the workers "
                        "finished (default: 30)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping (default: 5)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="add to every process's environment (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the worker command, after '--'")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no worker command; put it after '--', e.g. -- python train.py")
    try:
        env = _parse_env(args.env)
        launcher = Launcher(command, args.num_workers, args.num_servers, args.deadline, env,
                            shutdown_timeout=args.shutdown_timeout, grace=args.grace)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    launcher.say(f"{_plural(args.num_workers, 'worker')}, {_plural(args.num_servers, 'server')}: "
               f"{shlex.join(command)}")

    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_sigterm(signum, frame):
            raise _Terminated()

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return launcher.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
