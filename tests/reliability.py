"""What the soak and chaos tests share: running the commands in-process, and their checks.

The tools start every job's processes themselves, with deadlines, and kill what is left of
them (only their own processes, found by the job's marker) before they return.
"""

from __future__ import annotations

import json
import os
from typing import List

import pytest

from bytescheduler_tools.bench import chaos, soak

STEPS = 2000
EVERY = 50
DEADLINE = 240  # seconds per job; a tiny model's 2,000 steps take 10-30 s here


def clear_caller_settings(patch: pytest.MonkeyPatch) -> None:
    """The caller's BYTESCHEDULER_* settings would pass through to the job: not in a test."""
    for name in list(os.environ):
        if name.startswith("BYTESCHEDULER_"):
            patch.delenv(name)


@pytest.fixture(autouse=True)
def no_caller_settings(monkeypatch):
    """:func:`clear_caller_settings` for each test of a module that imports this fixture."""
    clear_caller_settings(monkeypatch)


def run_soak(out, adapter: str, *options: str) -> dict:
    """Run the soak command for ``adapter``; its result, with the command's exit status."""
    status = soak.main(["--adapters", adapter, "--steps", str(STEPS), "--sample-every", str(EVERY),
                        "--deadline", str(DEADLINE), "--out", str(out), *options])
    with open(os.path.join(out, "soak.json")) as handle:
        data = json.load(handle)
    assert data["settings"]["warmup"] == 400 and data["settings"]["rss_mib"] == 8.0
    result = data["results"][0]
    result["status"] = status
    return result


def check_flat(result: dict, fixed: bool = False) -> None:
    """The job finished cleanly and every rank stayed flat after warm-up."""
    assert result["finished"], result["problems"]
    assert result["flat"], result["problems"]
    assert result["status"] == 0
    assert not result["left_running"] and not result["ports_left"], result
    assert result["ports"], "no listening port seen: the job's ports were not watched"
    assert sorted(result["ranks"]) == ["0", "1"]
    for rank, data in result["ranks"].items():
        verdict = data["verdict"]
        # Samples at 400, 450, ..., 2000: the verdict is not made on too few.
        assert verdict["samples_after_warmup"] == (STEPS - 400) // EVERY + 1, (rank, verdict)
        assert verdict["last"]["step"] == STEPS
        assert sum(data["modes"].values()) == STEPS, data["modes"]
        if fixed:
            assert data["modes"] == {"fixed": STEPS}, data["modes"]
        assert data["closed"] is not None, "no sample after close()"
        assert data["seconds_per_step"] > 0


CHAOS_TIMEOUT = 5.0  # the adapters' timeout= in the chaos tests
# Slack past the timeout for a stalled peer's error on this loaded 2-core machine (seen up to
# 13 s with a 5 s timeout); a killed peer's error must come within 2 s (tests/test_chaos.py).
CHAOS_MARGIN = 8.0


def run_chaos(out, adapter: str, *options: str) -> List[dict]:
    """Run the chaos command for ``adapter`` with a short timeout; its trials' records."""
    chaos.main(["--adapters", adapter, "--timeout", str(CHAOS_TIMEOUT), "--margin", str(CHAOS_MARGIN),
                "--exit-grace", "40", "--startup", "120", "--seed", "15", "--out", str(out), *options])
    with open(os.path.join(out, "chaos.json")) as handle:
        return json.load(handle)["trials"]


def check_nothing_left(trial: dict) -> None:
    """Every process of the trial's job exited by itself, and every port it listened on is free."""
    verdict = trial["verdict"]
    assert trial["ports"], "no listening port seen: the job's ports were not watched"
    assert verdict["all_exited"], f"left running: {trial['left_running']}; logs in {trial['log_dir']}"
    assert verdict["ports_freed"], f"still listening: {trial['ports_left']}; logs in {trial['log_dir']}"
