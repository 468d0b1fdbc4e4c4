"""ScheduledKVStore on real ps-lite jobs (127.0.0.1, dist_sync, 2 workers, 1 or 2 servers).

Run in ``.venv-mxnet``. Each job goes through our launcher with a deadline; the launcher
returning 0 means every process (scheduler, servers, workers) exited.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bytescheduler.mxnet.launch import launch

WORKERS = Path(__file__).resolve().parent / "workers"
PY = sys.executable
DEADLINE = 90.0
TIMEOUT = 200


def run_job(script, *args, servers=1, workers=2):
    output, messages = io.StringIO(), io.StringIO()
    status = launch([PY, str(WORKERS / script), *map(str, args)], num_workers=workers, num_servers=servers,
                    deadline=DEADLINE, output=output, messages=messages, grace=3.0)
    return status, f"--- output\n{output.getvalue()}\n--- messages\n{messages.getvalue()}"


def load_params(path):
    import mxnet as mx  # noqa: F401 - imported lazily: MXNet only in this test's process

    return {k: v.asnumpy() for k, v in mx.nd.load(str(path)).items()}


# --- (a) push / pull / pushpull sums equal the unwrapped store exactly --------------------------
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("servers", [1, 2])
def test_sums_equal_unwrapped_store(servers, tmp_path):
    for mode in ("plain", "wrapped"):
        status, text = run_job("kv_sums.py", mode, tmp_path, servers=servers)
        assert status == 0, text
        assert len(re.findall(rf"DONE rank=\d mode={mode}", text)) == 2, text
    for rank in (0, 1):
        plain = np.load(tmp_path / f"plain-rank{rank}.npz")
        ours = np.load(tmp_path / f"wrapped-rank{rank}.npz")
        assert sorted(plain.files) == sorted(ours.files)
        for name in plain.files:
            assert np.array_equal(plain[name], ours[name]), name


# --- (b) gluon training equals training with the unwrapped store ---------------------------------
@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("update_on_kv, overlap, hybrid, servers", [
    ("1", "1", "0", 1),   # server-side SGD, forward overlapped with the pulls (per-block hooks)
    ("1", "1", "1", 2),   # hybridized: the top-level hook waits; 2 servers
    ("1", "0", "0", 2),   # no overlap: pushpull returns once its pulls are queued
    # Not here: update_on_kvstore=False (gradients pushpulled in place, local update). Unwrapped
    # dist_sync is itself nondeterministic in that mode on this machine (1 run in 3 ended with
    # the two workers holding different weights), so it is no reference; see docs/mxnet.md.
])
def test_gluon_training_equals_unwrapped(update_on_kv, overlap, hybrid, servers, tmp_path):
    # Unwrapped dist_sync with update_on_kvstore=False is itself nondeterministic (seen here: 1
    # run in 3 ends with the two workers holding different weights). A reference run counts
    # only when both workers agree; such a run is reproducible.
    for _ in range(4):
        status, text = run_job("train_mlp.py", "plain", update_on_kv, "0", hybrid, tmp_path / "plain",
                               servers=servers)
        assert status == 0, text
        a, b = load_params(tmp_path / "plain-rank0.params"), load_params(tmp_path / "plain-rank1.params")
        if all(np.array_equal(a[k], b[k]) for k in a):
            break
    else:
        pytest.fail("unwrapped dist_sync never gave a consistent reference in 4 runs")
    status, text = run_job("train_mlp.py", "wrapped", update_on_kv, overlap, hybrid, tmp_path / "ours",
                           servers=servers)
    assert status == 0, text
    assert len(re.findall(r"STATS rank=\d", text)) == 2, text
    for rank in (0, 1):
        plain = load_params(tmp_path / f"plain-rank{rank}.params")
        ours = load_params(tmp_path / f"ours-rank{rank}.params")
        assert len(plain) == 6 and plain.keys() == ours.keys()
        for name in plain:
            assert np.array_equal(plain[name], ours[name]), (rank, name, np.abs(plain[name] - ours[name]).max())
    # both ranks end with the same weights
    a, b = load_params(tmp_path / "ours-rank0.params"), load_params(tmp_path / "ours-rank1.params")
    assert all(np.array_equal(a[k], b[k]) for k in a)


# --- (c) local store: unchanged results ----------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_local_store_passes_through():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    done = subprocess.run([PY, str(WORKERS / "kv_local.py")], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LOCAL OK" in done.stdout


# --- (d) clear errors ----------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_bad_inputs_give_clear_errors():
    status, text = run_job("kv_errors.py")
    assert status == 0, text
    assert len(re.findall(r"DONE rank=\d", text)) == 2, text
    for words in ("unknown kvstore type 'bogus'", "was not initialised", "cannot mix int and str keys",
                  "has shape (4,) but the key was initialised with shape (40,)", "per-tensor norms"):
        assert words in text, (words, text)


@pytest.mark.timeout(TIMEOUT)
def test_stalled_peer_raises_within_timeout():
    status, text = run_job("kv_stall.py")
    assert status == 7, text
    match = re.search(r"RAISED (\w+) after ([\d.]+) s", text)
    assert match, text
    assert match.group(1) == "CommunicationTimeout", text
    assert float(match.group(2)) < 5.0 + 3.0, text
