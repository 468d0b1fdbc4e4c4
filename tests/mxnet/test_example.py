"""examples/mxnet_gluon_ps.py as a user runs it: ``bytescheduler mxnet-launch -n 2 -s 2 -- python ...``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mxnet.processes import MARKER, assert_nothing_left

PY = sys.executable
CONSOLE = Path(PY).parent / "bytescheduler"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mxnet_gluon_ps.py"
TIMEOUT = 200


@pytest.mark.timeout(2 * TIMEOUT)
def test_example_prints_the_same_checksum_with_and_without_bytescheduler(marker):
    checksums = {}
    for label, options in (("bytescheduler", ["--partition", "256KiB", "--credit", "1MiB"]),
                           ("plain dist_sync", ["--no-bytescheduler"])):
        done = subprocess.run(
            [str(CONSOLE), "mxnet-launch", "-n", "2", "-s", "2", "--deadline", "150", "--",
             PY, str(EXAMPLE), "--steps", "4", "--warmup", "1", "--batch-size", "8", *options],
            env=dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: marker}), capture_output=True, text=True,
            timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        text = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        assert done.returncode == 0, text
        assert "all 2 workers finished" in done.stderr, text
        for rank in (0, 1):
            assert re.search(rf"^\[worker \d\] rank {rank}: {label}: median [\d.]+ ms per iteration over 4 "
                             r"iterations", done.stdout, re.M), text
        found = dict(re.findall(r"^\[worker \d\] rank (\d): CHECKSUM ([0-9a-f]{16})$", done.stdout, re.M))
        assert sorted(found) == ["0", "1"] and found["0"] == found["1"], text
        checksums[label] = found["0"]
        assert_nothing_left(marker, done.stderr)
    # the dense layer (4 MiB) went in 256 KiB pieces; the math is the same as without scheduling
    assert checksums["bytescheduler"] == checksums["plain dist_sync"], checksums
