"""BYTESCHEDULER_DEBUG logs to stderr with the rank in every line, and to no file."""

import os
import subprocess
import sys

SCRIPT = """
from bytescheduler.core import Scheduler, Task
class Immediate:
    def launch(self, op, done):
        done(None)
with Scheduler(Immediate(), rank=3) as scheduler:
    scheduler.submit(Task(key=0, numel=8, itemsize=4, priority=0, payload=None)).result(timeout=10)
"""


def _run(tmp_path, debug):
    env = dict(os.environ, BYTESCHEDULER_DEBUG=debug)
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_debug_logs_to_stderr_with_rank_prefix_and_no_file(tmp_path):
    done = _run(tmp_path, "1")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("[bytescheduler rank 3]") for line in lines), lines
    assert any("DEBUG" in line and "stopped" in line for line in lines)
    assert os.listdir(tmp_path) == []


def test_debug_off_is_silent(tmp_path):
    done = _run(tmp_path, "0")
    assert done.returncode == 0 and done.stderr == ""


def test_bad_debug_value_names_the_variable(tmp_path):
    done = _run(tmp_path, "loud")
    assert done.returncode != 0
    assert "BYTESCHEDULER_DEBUG" in done.stderr and "DEBUG, INFO" in done.stderr
