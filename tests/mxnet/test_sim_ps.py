"""The simulator's parameter server uses ScheduledKVStore's own defaults and key layout; the
calibration probe measures a real ps-lite job."""

import json
import subprocess
import sys

import mxnet as mx
import pytest

from bytescheduler.mxnet.keys import SUBKEY_BASE, KeyLayout
from bytescheduler.mxnet.kvstore import KVSTORE_DEFAULTS, num_servers, store_defaults
from bytescheduler_tools.sim import ps
from bytescheduler_tools.sim.calibration import derive
from bytescheduler_tools.sim.engine import default_config
from bytescheduler_tools.sim.training import Gradient


def test_the_simulated_store_has_the_stores_defaults():
    assert default_config("ps-scheduled") == KVSTORE_DEFAULTS
    assert default_config("mxnet-scheduled") == KVSTORE_DEFAULTS
    assert ps.SUBKEY_BASE == SUBKEY_BASE
    # the partition follows the number of servers in both
    for servers in (1, 2, 4, 8, 16, 32, 64, 1000):
        assert default_config("ps-scheduled", servers=servers) == store_defaults(servers), servers
    assert [store_defaults(n).partition_bytes // 2**10 for n in (2, 8, 32)] == [4096, 1024, 256]


def test_the_number_of_servers_comes_from_the_launchers_variable():
    assert num_servers({}) == 1
    assert num_servers({"DMLC_NUM_SERVER": " 16 "}) == 16
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="DMLC_NUM_SERVER=.*positive integer"):
            num_servers({"DMLC_NUM_SERVER": bad})


def test_the_simulated_layout_is_the_stores():
    grain = 4 * 2**20
    sizes = [1000, 3 * 2**20, 9 * 2**20 + 4, 4 * 2**20, 17 * 2**20]
    layout = KeyLayout(grain)
    infos = layout.register([(key, mx.nd.zeros((size // 4,))) for key, size in enumerate(sizes)])
    simulated = ps.grain_layout([Gradient(key, size, 0.0, key) for key, size in enumerate(sizes)], 2, grain)
    for info in infos:
        keys = simulated[info.key]
        assert [k.key for k in keys] == list(info.subkeys)
        assert [k.nbytes for k in keys] == [(stop - start) * 4 for start, stop in info.grains]


@pytest.mark.timeout(300)
def test_the_calibration_probe_measures_ps_lite(tmp_path, marker):
    """The probe ``bytescheduler calibrate`` runs on each worker, on a real ps-lite job (2
    workers, 2 servers; not pinned, so the servers' CPU is not told apart here)."""
    done = subprocess.run(
        [sys.executable, "-m", "bytescheduler.launcher", "-n", "2", "-s", "2", "--deadline", "200", "--",
         sys.executable, "-m", "bytescheduler_tools.sim.probe_mxnet", "--small-ops", "40", "--large-ops", "3",
         "--megabytes", "8", "--output", str(tmp_path / "rank{rank}.json")],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world"] == 2 for r in reports)
    costs = derive("ps-lite", reports)
    memcpy = min(r["memcpy_bytes_per_s"] for r in reports)
    # A push-pull of 8 MiB through the loopback moves every byte at least twice.
    assert 0 < costs.rate < memcpy
    assert 0 < costs.op_seconds < 0.1 and costs.cpu_per_op > 0 and 0 < costs.cpu_per_byte < 1e-7
