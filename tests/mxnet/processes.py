"""Helpers of the multi-process MXNet tests: find, check and follow the processes a test started.

Every process a test starts carries ``MARKER=<a fresh value>`` in its environment (the
``marker`` fixture of conftest.py), so that after the test none may be left (checked through
/proc), and the fixture kills any that are, by that marker.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

from bytescheduler_tools.bench.procstats import alive as pid_alive
from bytescheduler_tools.bench.procstats import marked_pids as marked_processes

MARKER = "BYTESCHEDULER_TEST_MARKER"


def marked_pids(marker: str) -> List[int]:
    """Live processes whose environment holds ``MARKER=marker``."""
    return marked_processes(MARKER, marker)


def started_pids(messages: str) -> Dict[str, int]:
    """The ``name -> pid`` list the launcher reports when it has started everything."""
    line = next(line for line in messages.splitlines() if ": started " in line)
    return {name: int(pid) for name, pid in re.findall(r"(\w+ \d+) \(pid (\d+)\)", line)}


def assert_nothing_left(marker: str, messages: str) -> None:
    left = [pid for pid in marked_pids(marker) if pid_alive(pid)]
    assert not left, f"processes left running: {left}"
    pids = started_pids(messages)
    assert set(pids) >= {"scheduler 0", "server 0", "worker 0", "worker 1"}, pids
    alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert not alive, f"started processes still alive: {alive}"


class Streamed:
    """A launcher run in a child process, its output read line by line with timestamps."""

    def __init__(self, argv: List[str], marker: str, extra_env: Optional[Dict[str, str]] = None):
        env = dict(os.environ, **(extra_env or {}))
        env[MARKER] = marker
        self.start = time.monotonic()
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL)
        self.lines: "queue.Queue[Tuple[float, str, str]]" = queue.Queue()
        self.out: List[Tuple[float, str]] = []
        self.err: List[Tuple[float, str]] = []
        self._threads = [threading.Thread(target=self._read, args=(self.popen.stdout, "out")),
                         threading.Thread(target=self._read, args=(self.popen.stderr, "err"))]
        for thread in self._threads:
            thread.start()

    def _read(self, stream, which: str) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.put((time.monotonic(), which, line))
        stream.close()

    def _drain(self) -> None:
        while True:
            try:
                when, which, line = self.lines.get_nowait()
            except queue.Empty:
                return
            (self.out if which == "out" else self.err).append((when, line))

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60.0) -> float:
        """Wait until ``count`` stdout lines match ``pattern``; return when the last one came."""
        end = time.monotonic() + timeout
        while True:
            self._drain()
            hits = [when for when, line in self.out if re.search(pattern, line)]
            if len(hits) >= count:
                return hits[count - 1]
            if time.monotonic() > end or self.popen.poll() is not None:
                self.finish(10)
                raise AssertionError(f"no {count} lines matching {pattern!r}:\n{self.text()}")
            time.sleep(0.05)

    def finish(self, timeout: float = 150.0) -> Tuple[int, float]:
        """Wait for the launcher to exit; return its status and the time it exited."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.text()}")
        ended = time.monotonic()
        for thread in self._threads:
            thread.join(10)
        self._drain()
        return code, ended

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.err)

    def text(self) -> str:
        self._drain()
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def assert_job_stops(run: Streamed, trigger: str, status: int, messages: List[str], within: float,
                     marker: str) -> None:
    """The launcher ``run`` stops the job soon after the stdout line matching ``trigger``.

    It must exit with ``status`` less than ``within`` seconds after that line, print every
    regular expression of ``messages`` on stderr, and leave no process running.
    """
    happened = run.wait_for(trigger)
    code, ended = run.finish()
    assert code == status, run.text()
    for pattern in messages:
        assert re.search(pattern, run.stderr, re.M), (pattern, run.text())
    assert ended - happened < within, run.text()
    assert_nothing_left(marker, run.stderr)
