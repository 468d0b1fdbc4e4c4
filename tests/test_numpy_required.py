"""Without numpy, torch's object collectives fail late and vaguely: bytescheduler says so at once."""

import subprocess
import sys

from bytescheduler.pytorch.groups import require_numpy

_WITHOUT_NUMPY = """
import sys
sys.modules["numpy"] = None  # import numpy now raises ImportError, for torch as for us
from bytescheduler.pytorch.groups import require_numpy
try:
    require_numpy()
except ImportError as error:
    print("ImportError:", error)
else:
    print("no error")
"""


def test_a_missing_numpy_is_named_with_the_fix():
    done = subprocess.run([sys.executable, "-c", _WITHOUT_NUMPY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ImportError: bytescheduler needs numpy" in done.stdout and "pip install numpy" in done.stdout, done.stdout


def test_numpy_present_passes():
    require_numpy()
