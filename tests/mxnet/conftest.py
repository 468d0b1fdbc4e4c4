"""The MXNet tests run only where MXNet works (``.venv-mxnet``; ``make mxnet`` builds it).

Collected anywhere else, they stop the whole run with an error instead of skipping. MXNet is
imported in a child process (its workers are child processes too), so the pytest process
itself stays free of MXNet's threads.
"""

import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.mxnet.processes import marked_pids

CHECK = "import mxnet, numpy; print(mxnet.__version__, numpy.__version__)"


def _check_mxnet() -> str:
    # Without DMLC_* variables: with DMLC_ROLE=server, importing mxnet would start a server.
    env = {key: value for key, value in os.environ.items() if not key.startswith("DMLC_")}
    try:
        done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "importing mxnet took more than 120 s"
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    return ""


_problem = _check_mxnet()
if _problem:
    pytest.exit(
        f"tests/mxnet needs a working MXNet in {sys.executable} ({_problem}). "
        "Run them in .venv-mxnet: make mxnet && .venv-mxnet/bin/python -m pytest tests/mxnet",
        returncode=3,
    )


@pytest.fixture
def marker():
    """A fresh value for ``MARKER`` in the environment of the processes a test starts.

    After the test, any such process still running is killed (only after a failed test).
    """
    value = uuid.uuid4().hex
    yield value
    for pid in marked_pids(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
