"""Faults at random moments: ``bytescheduler chaos`` on 2 real ranks, a few trials per adapter.

Rank 1 sends itself SIGKILL a random fraction into forward, backward, ``step()`` or
``close()``, or SIGSTOP (rank 1 stalls past the 5 s timeout, then is continued). Rank 0 must
raise a clear bytescheduler error within the timeout plus 5 s (the DDP hook's reaches
``backward()`` inside DDP's RuntimeError, which names it), or finish when rank 1 died after
its last communication; every process of the job must exit by itself and every port it
listened on must be free.

The faults come at step 2, inside the mode switch's warm-up, where every adapter schedules:
after it, small models mostly run the framework's own path, where a dead peer is the
framework's own error (docs/reliability.md; the full campaign covers every step). The MXNet
twin is tests/mxnet/test_chaos.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.reliability import (  # noqa: F401 - autouse fixture
    CHAOS_MARGIN, CHAOS_TIMEOUT, check_nothing_left, no_caller_settings, run_chaos,
)

AT_STEP_2 = ("--fault-steps", "2", "3")


def check_clear_error(trial: dict, fast: bool) -> None:
    """Rank 0 raised a clear error in time: at once for a dead peer, after the timeout for a stalled one."""
    survivor, verdict = trial["survivor"], trial["verdict"]
    assert verdict["outcome"] == "clear error", f"{verdict['outcome']}: {survivor}; logs in {trial['log_dir']}"
    if fast:  # a dead peer's sockets close: noticed long before the timeout
        assert verdict["seconds"] < 2.0, verdict
    else:  # a stopped peer looks alive: the timeout, not earlier, and not much later
        # Our watchdog's CommunicationTimeout, or gloo's own timeout (our groups get the same
        # one) as a CommunicationError: "Application timeout caused pair closure".
        assert CHAOS_TIMEOUT - 0.5 <= verdict["seconds"] <= CHAOS_TIMEOUT + CHAOS_MARGIN, verdict


def check_quick_exit(trial: dict) -> None:
    """Every process of a job whose rank 1 was killed ended within 5 s of the kill: nothing
    waits for operations on the dead peer (they fail at once). A failure's traceback once held
    their tensors and close() waited 10 s for them, the exit handler 5 s more (~16 s)."""
    assert trial["verdict"]["exit_seconds"] < 5.0, (trial["verdict"], trial["log_dir"])


@pytest.mark.parametrize("adapter", ["optimizer", "hook"])
def test_a_rank_killed_in_any_phase_is_a_clear_error_and_leaves_nothing(tmp_path, adapter):
    trials = run_chaos(tmp_path, adapter, "--trials", "4", "--stop-trials", "0", *AT_STEP_2)
    assert [trial["plan"]["case"] for trial in trials] == ["kill-forward", "kill-backward", "kill-step", "kill-close"]
    for trial in trials:
        assert trial["fault"]["signal"] == "SIGKILL" and trial["exit_codes"]["rank1"] == -9, trial
        if trial["plan"]["case"] == "kill-close":
            # Rank 1 may die after its last collective: rank 0 then finishes, which is right.
            assert trial["verdict"]["reaction_ok"], trial["verdict"]
        else:
            check_clear_error(trial, fast=True)
            assert trial["exit_codes"]["rank0"] == 3, trial["exit_codes"]  # the trainee's "training raised"
        check_nothing_left(trial)
        check_quick_exit(trial)


@pytest.mark.parametrize("adapter", ["optimizer", "hook", "horovod"])
def test_a_stalled_rank_is_a_timeout_on_both_sides_and_leaves_nothing(tmp_path, adapter):
    (trial,) = run_chaos(tmp_path, adapter, "--trials", "0", "--stop-trials", "1", *AT_STEP_2)
    assert trial["fault"]["signal"] == "SIGSTOP"
    check_clear_error(trial, fast=False)
    # Continued once rank 0 gave up, rank 1 finds its peer gone: a clear error too, not a hang.
    after = trial["victim_after"]
    assert after is not None and after["event"] == "error" and after["clear"], after
    check_nothing_left(trial)


def test_a_horovod_rank_killed_is_a_clear_error_and_leaves_nothing(tmp_path):
    trials = run_chaos(tmp_path, "horovod", "--trials", "2", "--stop-trials", "0", *AT_STEP_2)
    assert [trial["plan"]["case"] for trial in trials] == ["kill-forward", "kill-backward"]
    for trial in trials:
        check_clear_error(trial, fast=True)
        check_nothing_left(trial)
        check_quick_exit(trial)
        assert trial["exit_codes"]["rendezvous"] == -9  # the helper, stopped by the tool as horovodrun would


def test_the_command_is_bytescheduler_chaos():
    run = subprocess.run([sys.executable, "-m", "bytescheduler", "chaos", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "--stop-trials" in run.stdout and "--fault-steps" in run.stdout, run.stderr
