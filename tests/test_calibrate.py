"""``bytescheduler calibrate`` on 2 real local ranks per backend: gloo, Horovod, MXNet's ps-lite."""

import json
import subprocess
import sys

import pytest

from bytescheduler_tools.sim.calibration import Calibration, derive


def _calibrate(tmp_path, backend):
    out = tmp_path / "calibration.json"
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.cli", "calibrate", "--backends", backend, "--small-ops", "60",
         "--large-ops", "3", "--megabytes", "8", "--out", str(out), "--deadline", "240"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"| {backend} |" in done.stdout
    return Calibration.load(str(out))


@pytest.mark.parametrize("backend", ["gloo", "horovod", "ps-lite"])
def test_calibrate_measures_what_one_operation_and_one_byte_cost(tmp_path, backend):
    calibration = _calibrate(tmp_path, backend)
    costs = calibration.backend(backend)
    assert calibration.cores == 1 and calibration.memcpy_bytes_per_s > 1e8
    # A 2-rank operation on loopback copies every byte through the kernel, both ways: it is
    # slower than one thread's memory copy, and it costs CPU per byte.
    assert 0 < costs.rate < calibration.memcpy_bytes_per_s
    assert 0 < costs.cpu_per_byte < 1e-7
    reports = calibration.raw[backend]
    assert [r["rank"] for r in sorted(reports, key=lambda r: r["rank"])] == [0, 1]
    small = sorted(wall for report in reports for wall in report["small"]["walls"])
    if backend == "horovod":
        # Horovod's background thread turns once per cycle (1 ms): a small operation issued
        # right after the last one completed waits for the next turn.
        assert small[len(small) // 2] >= 0.5e-3
        assert costs.idle_cpu_per_s > 0  # it negotiates every turn, with nothing to do too
        assert costs.ours_cpu_per_poll > 0
    else:
        assert 0 < costs.op_seconds < 0.1 and costs.cpu_per_op > 0
    if backend == "ps-lite":
        assert costs.server_cpu_per_byte > 0  # the servers sum and update every push
    else:
        assert costs.ours_cpu_per_op > 0  # bytescheduler's dispatcher, measured on a real run
    # The same numbers come back from the raw reports.
    assert derive(backend, reports) == costs


def test_calibrate_refuses_an_unknown_backend_and_a_missing_file(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bytescheduler.cli", "calibrate", "--backends", "nccl"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "invalid choice: 'nccl'" in done.stderr
    with pytest.raises(ValueError, match="bytescheduler calibrate --out"):
        Calibration.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"backends": {"gloo": {"op_seconds": "fast"}}}))
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.load(str(tmp_path / "bad.json"))
