"""bytescheduler.mxnet.engine against MXNet's real engine, in a child process (see conftest)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "engine_readable.py"


@pytest.fixture(scope="module")
def cases():
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    found = {}
    for name, fields in re.findall(r"^CASE (\w+) (.*)$", done.stdout, re.M):
        found[name] = dict(re.findall(r"(\w+)=(\S+)", fields))
    assert sorted(found) == ["failed", "order", "several"], done.stdout + done.stderr
    return found


def test_a_computed_array_is_told_before_one_still_being_computed(cases):
    """Registered after a slow array, a ready one is told at once; the slow one only once its
    computation finished (``wait_to_read`` right after the callback returns at once)."""
    order = cases["order"]
    assert order["calls"] == "ready,slow", order
    assert order["before"] == "ready", order  # 50 ms in: the ready one told, the slow one not
    assert float(order["slow_after"]) > 0.1, order
    assert float(order["wait_after"]) < 0.02, order


def test_a_failed_computation_is_still_told_and_raises_after(cases):
    """MXNet skips the operations reading a failed result; the callback comes anyway (from the
    release of the operation's parameter) and ``wait_to_read`` then raises MXNet's error."""
    assert cases["failed"] == {"came": "True", "raised": "MXNetError"}, cases["failed"]


def test_several_arrays_are_told_once_when_all_are_computed(cases):
    several = cases["several"]
    assert several["count"] == "1", several
    assert float(several["came"]) > 0.1, several
    assert float(several["wait_after"]) < 0.02, several
