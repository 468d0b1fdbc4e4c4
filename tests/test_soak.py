"""Long runs stay flat: ``bytescheduler soak`` on 2 real ranks per adapter, 2,000 steps each.

Every rank samples its RSS, threads, open descriptors and sockets every 50 steps; after the
warm-up (400 steps) RSS may grow by at most 8 MiB and the counts may not change at all
(``bytescheduler_tools.bench.soak.judge``). The 10,000-step run per adapter is a documented command
(docs/reliability.md). The MXNet twin is tests/mxnet/test_soak.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bytescheduler_tools.bench import soak
from tests.reliability import check_flat, no_caller_settings, run_soak  # noqa: F401 - autouse fixture


@pytest.mark.parametrize("adapter", ["optimizer", "hook", "horovod"])
def test_every_rank_stays_flat_over_2000_steps(tmp_path, adapter):
    """The adapter as users get it: the mode switch on (small models mostly take the plain path)."""
    check_flat(run_soak(tmp_path, adapter))


@pytest.mark.parametrize("adapter", ["optimizer", "hook"])
def test_every_rank_stays_flat_over_2000_scheduled_steps(tmp_path, adapter):
    """The mode switch off: all 2,000 steps through the scheduler, its threads and channels."""
    check_flat(run_soak(tmp_path, adapter, "--schedule-only"), fixed=True)


def _samples(rss_kib_per_step: float = 0.0, **changes) -> list:
    samples = []
    for step in range(50, 2001, 50):
        sample = {"step": step, "rss_kib": 400_000 + int(rss_kib_per_step * step), "threads": 12, "fds": 40,
                  "sockets": 9}
        for name, (at, value) in changes.items():
            if step >= at:
                sample[name] = value
        samples.append(sample)
    return samples


def test_judge_finds_growth_after_warm_up_and_nothing_else():
    assert soak.judge(_samples(), warmup=400)["flat"]
    # Growth during warm-up is allowed: RSS 40 MiB higher from step 300 on.
    assert soak.judge(_samples(rss_kib=(300, 440_000)), warmup=400)["flat"]
    # 5 KiB a step is 7.8 MiB over steps 400-2000: still within 8 MiB; 6 KiB a step is not.
    assert soak.judge(_samples(rss_kib_per_step=5), warmup=400)["flat"]
    leak = soak.judge(_samples(rss_kib_per_step=6), warmup=400)
    assert not leak["flat"] and leak["problems"] == ["RSS grew 9.4 MiB after warm-up (allowed 8 MiB)"]
    assert leak["rss_mib_per_1000_steps"] == pytest.approx(6 * 1000 / 1024)
    # One thread, descriptor or socket more after warm-up, even for a while, is not flat.
    for name in ("threads", "fds", "sockets"):
        verdict = soak.judge(_samples(**{name: (1200, 13)}), warmup=400)
        assert not verdict["flat"] and verdict["problems"][0].startswith(f"{name} changed after warm-up"), verdict
    assert not soak.judge(_samples(), warmup=2500)["flat"]  # no sample to judge: not flat


def test_the_command_is_bytescheduler_soak():
    run = subprocess.run([sys.executable, "-m", "bytescheduler", "soak", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "--rss-mib" in run.stdout and "--schedule-only" in run.stdout, run.stderr
