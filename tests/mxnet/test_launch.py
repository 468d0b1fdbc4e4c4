"""The MXNet parameter-server launcher on real ps-lite processes (127.0.0.1, ``dist_sync``).

Run in ``.venv-mxnet`` (``make mxnet``). Every job has a deadline, every subprocess a timeout,
and every process a test starts carries a marker variable in its environment: after each test
none may be left (checked through /proc), and the fixture kills any that are, by that marker.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from bytescheduler.launcher import EXIT_DEADLINE, EXIT_INTERRUPTED, EXIT_TERMINATED, ENGINE_KEYS, Launcher, engine_hint, launch
from tests.mxnet.processes import MARKER, Streamed, assert_job_stops, assert_nothing_left, marked_pids, pid_alive

WORKERS = Path(__file__).resolve().parent / "workers"
PY = sys.executable
JOB_DEADLINE = 90.0  # seconds; a healthy job takes about 4-7 s on 2 cores
SUBPROCESS_TIMEOUT = 150.0
ROUNDS, KEYS = 2, 3  # as in workers/push_pull.py

LAUNCHER = [PY, "-m", "bytescheduler.launcher"]
# Python leaves SIGINT ignored in a child started with SIGINT ignored (as in a background job);
# the Ctrl-C test needs the usual KeyboardInterrupt, so that launcher restores the handler.
LAUNCHER_WITH_SIGINT = [
    PY, "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from bytescheduler.launcher import main; sys.exit(main(sys.argv[1:]))",
]


def worker(name: str) -> List[str]:
    return [PY, str(WORKERS / name)]


def check_sums(output: str, workers: int) -> None:
    """Every rank printed every check of workers/push_pull.py, and no failure."""
    assert "CHECK FAILED" not in output, output
    for rank in range(workers):
        oks = re.findall(rf"^\[worker \d\] CHECK OK rank={rank} ", output, re.M)
        assert len(oks) == ROUNDS * KEYS, (rank, output)
        assert re.search(rf"^\[worker \d\] DONE rank={rank} failures=0$", output, re.M), output


# --- (a) real dist_sync jobs through the Python API ----------------------------------------
@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
@pytest.mark.parametrize("servers", [1, 2])
def test_dist_sync_push_pull_sums(servers, marker):
    output, messages = io.StringIO(), io.StringIO()
    start = time.monotonic()
    status = launch(worker("push_pull.py"), num_workers=2, num_servers=servers, deadline=JOB_DEADLINE,
                    env={MARKER: marker}, output=output, messages=messages)
    elapsed = time.monotonic() - start
    text = f"--- output\n{output.getvalue()}\n--- messages\n{messages.getvalue()}"
    assert status == 0, text
    check_sums(output.getvalue(), workers=2)
    # The scheduler numbers the workers; both ranks appear, whatever the launch order.
    assert sorted(re.findall(r"START rank=(\d) workers=2", output.getvalue())) == ["0", "1"], text
    assert "all 2 workers finished" in messages.getvalue(), text
    assert elapsed < JOB_DEADLINE
    assert_nothing_left(marker, messages.getvalue())


@pytest.mark.parametrize("outside, given, expected", [
    ({}, {}, "1"),                                                          # the launcher's default
    ({"MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": "8"}, {}, "8"),            # the user's environment wins
    ({}, {"MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": "4"}, "4"),            # so does launch(env=...)
    ({"MXNET_EXEC_BULK_EXEC_TRAIN": "0"}, {}, None),                        # no bulks at all: left alone
])
def test_every_process_gets_the_backward_in_bulks_of_one_unless_set(outside, given, expected, monkeypatch):
    for key in ENGINE_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in outside.items():
        monkeypatch.setenv(key, value)
    launcher = Launcher(worker("push_pull.py"), num_workers=2, num_servers=1, env=given)
    for role in ("scheduler", "server", "worker"):
        env = launcher._node_env(role, 0)
        assert env.get("MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD") == expected, (role, env)
        assert (engine_hint(env) is None) and env["DMLC_ROLE"] == role


# --- (b) a failing worker stops the whole job at once ----------------------------------------
@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
def test_crashed_worker_stops_the_job(marker):
    run = Streamed(LAUNCHER + ["-n", "2", "-s", "1", "--deadline", str(JOB_DEADLINE), "--",
                               *worker("crash.py")], marker)
    # Left alone, the others would wait forever; the launcher ends them by SIGTERM at once.
    assert_job_stops(run, r"^\[worker 1\] CRASHING", 3, [r"worker 1 \(pid \d+\) exited with code 3",
                                                         "stopping scheduler 0, server 0, worker 0"], 5.0, marker)
    assert "SIGKILL" not in run.stderr, run.text()


@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
def test_worker_exception_through_run_worker_stops_the_job(marker):
    run = Streamed(LAUNCHER + ["-n", "2", "-s", "1", "--deadline", str(JOB_DEADLINE), "--",
                               *worker("raise_error.py")], marker)
    assert_job_stops(run, r"^\[worker 1\] RuntimeError: worker failure on purpose", 1,
                     [r"worker 1 \(pid \d+\) exited with code 1"], 5.0, marker)
    assert "[worker 1] Traceback (most recent call last):" in run.stdout, run.text()


@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
def test_first_failure_gives_the_status_when_another_follows_at_once(marker, tmp_path):
    # Worker 0 fails 30 ms after worker 1 died, sometimes before the launcher has stopped it. The
    # status, and the first failure named, must still be worker 1's: its death caused the other.
    for attempt in range(5):
        output, messages = io.StringIO(), io.StringIO()
        status = launch(worker("dies_after_peer.py") + [str(tmp_path / f"peer-{attempt}.sock")], num_workers=2,
                        num_servers=1, deadline=JOB_DEADLINE, env={MARKER: marker}, output=output,
                        messages=messages)
        text = f"--- output\n{output.getvalue()}\n--- messages\n{messages.getvalue()}"
        assert status == 3, text
        reports = re.findall(r"^\S+ mxnet-launch: (worker \d) \(pid \d+\) exited with code (\d+)$",
                             messages.getvalue(), re.M)
        stopped = re.search(r"^\S+ mxnet-launch: stopping .*worker 0", messages.getvalue(), re.M)
        assert reports == ([("worker 1", "3")] if stopped else [("worker 1", "3"), ("worker 0", "1")]), text
        assert_nothing_left(marker, messages.getvalue())


# --- (c) the deadline ------------------------------------------------------------------------
@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
def test_deadline_stops_a_job_that_runs_too_long(marker):
    deadline = 12.0
    run = Streamed(LAUNCHER + ["-n", "2", "-s", "1", "--deadline", str(deadline), "--grace", "3",
                               "--", *worker("sleep.py")], marker)
    run.wait_for(r"^\[worker \d\] READY", count=2, timeout=deadline)
    code, ended = run.finish()
    elapsed = ended - run.start
    assert code == EXIT_DEADLINE, run.text()
    assert "deadline of 12 s passed; stopping scheduler 0, server 0, worker 0, worker 1" in run.stderr, \
        run.text()
    # The launcher's own start counts against the deadline, then SIGTERM ends everything.
    assert deadline <= elapsed < deadline + 8.0, (elapsed, run.text())
    assert_nothing_left(marker, run.stderr)


# --- Ctrl-C and SIGTERM to the launcher -------------------------------------------------------
@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, EXIT_INTERRUPTED),
                                            (signal.SIGTERM, EXIT_TERMINATED)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_launcher_stops_every_process(signum, status, marker):
    run = Streamed(LAUNCHER_WITH_SIGINT + ["-n", "2", "-s", "2", "--deadline", str(JOB_DEADLINE), "--",
                                           *worker("sleep.py")], marker)
    run.wait_for(r"^\[worker \d\] READY", count=2)
    sent = time.monotonic()
    run.popen.send_signal(signum)
    code, ended = run.finish()
    assert code == status, run.text()
    assert ("interrupted" if signum == signal.SIGINT else "terminated") in run.stderr, run.text()
    assert ended - sent < 5.0, run.text()
    assert_nothing_left(marker, run.stderr)


# --- (d) the console command ------------------------------------------------------------------
@pytest.mark.timeout(SUBPROCESS_TIMEOUT)
def test_console_command_runs_a_job(marker):
    console = Path(PY).parent / "bytescheduler"
    assert console.exists(), f"{console} is missing: is bytescheduler installed in this environment?"
    done = subprocess.run(
        [str(console), "mxnet-launch", "-n", "2", "-s", "2", "--deadline", str(JOB_DEADLINE), "--",
         *worker("push_pull.py")],
        env=dict(os.environ, **{MARKER: marker}), capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT, stdin=subprocess.DEVNULL,
    )
    text = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, text
    check_sums(done.stdout, workers=2)
    assert "2 workers, 2 servers" in done.stderr, text
    assert_nothing_left(marker, done.stderr)


@pytest.mark.timeout(60)
def test_missing_worker_command_is_reported(marker):
    done = subprocess.run(LAUNCHER + ["-n", "2", "--", str(WORKERS / "no-such-program")],
                          env=dict(os.environ, **{MARKER: marker}), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 127, done
    assert "cannot start the job" in done.stderr and "no-such-program" in done.stderr, done.stderr
    # The scheduler and the server had already been started: they are stopped too.
    assert not [pid for pid in marked_pids(marker) if pid_alive(pid)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["-n", "2"], "no worker command"),
    (["-n", "2", "--"], "no worker command"),
    (["-n", "0", "--", "true"], "num_workers must be at least 1"),
    (["-n", "1", "-s", "0", "--", "true"], "num_servers must be at least 1"),
    (["-n", "1", "--deadline", "0", "--", "true"], "deadline must be positive"),
    (["-n", "1", "--env", "NOEQUALS", "--", "true"], "--env wants KEY=VALUE"),
])
def test_usage_errors(args, message):
    done = subprocess.run(LAUNCHER + args, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done
    assert message in done.stderr, done.stderr
