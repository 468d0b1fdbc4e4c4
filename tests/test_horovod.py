"""bytescheduler.pytorch.horovod under a real Horovod (gloo), 2 ranks started by horovodrun.

Each test runs one scenario of ``tests/horovod_worker.py`` on 2 processes and asserts on the
``RESULT {json}`` line each rank prints. Horovod is installed by the project's set-up
(``make test``), so nothing here is skipped: a missing Horovod is a failure.

What happens when a peer dies (observed with Horovod 0.28.1, gloo):

- Horovod's background loop on the surviving rank gets gloo's "Connection closed by peer"
  (or "Connection reset by peer"), logs it and shuts Horovod down; every pending
  ``allreduce_async_`` handle then fails with ``HorovodInternalError`` ("Horovod has been
  shut down"). bytescheduler turns that into ``bytescheduler.CommunicationError`` in the
  training thread within tens of milliseconds (long before its own timeout).
- horovodrun (non-elastic) terminates every other worker as soon as one exits non-zero
  (SIGTERM, then SIGKILL after 5 s) and exits with 1 naming the first failed process. The
  surviving rank is therefore often killed before (or just after) it reports the error.

So the test under horovodrun asserts the job-level behaviour (ends fast, non-zero, rank 1
named with its code), and a second test starts the two ranks with Horovod's own rendezvous
server but without horovodrun's kill-all, to assert rank 0's behaviour deterministically.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "horovod_worker.py")
BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")
TIMEOUT = 180  # seconds per job; a tiny job takes about 3 s, the largest about 15 s
DIES_TIMEOUT = 8  # the worker's ScheduledOptimizer timeout in the dies scenario

_RESULT = re.compile(r"RESULT (\{.*\})\s*$")


def _env() -> Dict[str, str]:
    """horovodrun starts whatever ``python`` is first on PATH: make it this interpreter."""
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in list(env):
        if name.startswith(("HOROVOD_", "BYTESCHEDULER_")):
            del env[name]  # a setting of the caller's must not change the scenario
    return env


def _kill(process: subprocess.Popen) -> None:
    """Kill what we started: the process group of ``process`` and its descendants, by pid.

    horovodrun's workers run in sessions of their own (its middleman calls setsid), so they
    are not in our group; their pids are collected before the group is killed.
    """
    descendants = []
    try:
        import psutil

        descendants = psutil.Process(process.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    process.wait(10)


def _communicate(process: subprocess.Popen, timeout: float, what: str) -> Tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"{what} did not finish within {timeout} s (a hang); killed.\n"
                    f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}")


def horovodrun(scenario: str, timeout: float = TIMEOUT, ranks: int = 2) -> Tuple[int, str, str, float]:
    """Run the worker's ``scenario`` on ``ranks`` ranks; return (exit code, stdout, stderr, seconds)."""
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable, WORKER, scenario]
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    stdout, stderr = _communicate(process, timeout, f"horovodrun {scenario}")
    return process.returncode, stdout, stderr, time.monotonic() - started


def results(stdout: str) -> Dict[int, dict]:
    """The RESULT line of each rank, by rank (horovodrun prefixes lines with ``[rank]<stdout>:``)."""
    found: Dict[int, dict] = {}
    for line in stdout.splitlines():
        match = _RESULT.search(line)
        if match:
            value = json.loads(match.group(1))
            found[value["rank"]] = value
    return found


def run_ok(scenario: str) -> Dict[int, dict]:
    code, stdout, stderr, _ = horovodrun(scenario)
    assert code == 0, f"exit code {code}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    found = results(stdout)
    assert sorted(found) == [0, 1], stdout[-4000:]
    return found


def _check_equal_runs(found: Dict[int, dict], expected: List[Tuple[str, str, int]], switching: bool = False) -> None:
    for rank, result in found.items():
        runs = result["runs"]
        assert [(r["model"], r["optimizer"], r["passes"]) for r in runs] == expected
        for run in runs:
            label = f"rank {rank} {run['model']} {run['optimizer']} passes={run['passes']}"
            # Bit-identical to hvd.DistributedOptimizer alone: a sum of 2 values is exact in any order.
            assert run["max_abs_diff"] == 0.0, label
            assert run["losses_equal"], label
            assert run["moved"] > 1e-4, f"{label}: training did not change the parameters"
            user_class = "SGD" if run["optimizer"] == "sgd" else "AdamW"
            assert run["isinstance"] and run["class_name"] == user_class, label
            baseline_lr, scheduled_lr = run["lr"]
            assert scheduled_lr == baseline_lr, label
            if run["optimizer"] == "adamw":
                assert scheduled_lr == pytest.approx(1e-3 * 0.5 ** 6), f"{label}: StepLR ran 30 steps"
            if switching:
                continue  # some steps ran Horovod's own path: the schedule's counts do not apply
            stats = run["stats"]
            assert stats["operations"] > 0, label
            # Partitioned: more operations than tensors x steps; no merging under Horovod.
            assert stats["operations"] > 30 * run["tensors"], f"{label}: {stats}"
            assert stats["pieces"] == stats["operations"], label
            assert 0 < stats["peak_in_flight_bytes"], label
    for index in range(len(expected)):
        assert found[0]["runs"][index]["checksum"] == found[1]["runs"][index]["checksum"], (
            "ranks hold different parameters"
        )


def test_scheduled_equals_horovod_distributed_optimizer():
    found = run_ok("equal")
    _check_equal_runs(found, [
        ("cnn-small", "sgd", 1), ("cnn-small", "adamw", 1), ("gpt2-small", "sgd", 1), ("gpt2-small", "adamw", 1),
    ])


def test_gradient_accumulation_equals_horovod():
    found = run_ok("accumulate")
    _check_equal_runs(found, [("cnn-small", "sgd", 2)])


def test_horovod_idioms_and_plain_optimizer_equal_horovod():
    """hvd.broadcast_optimizer_state after wrapping, a checkpoint round trip, a plain optimizer."""
    found = run_ok("idiom")
    _check_equal_runs(found, [
        ("cnn-small", "adamw", 1), ("gpt2-small", "sgd", 1), ("cnn-small", "sgd", 1), ("cnn-small", "adamw", 2),
    ])
    assert [(r["idiom"], r["plain"]) for r in found[0]["runs"]] == [
        (True, False), (True, False), (False, True), (False, True),
    ]


def test_mode_switch_runs_both_paths_alike_on_every_rank_and_keeps_the_numbers():
    """With short phases rank 0 switches between the schedule and Horovod's own path many
    times (plain Horovod optimizer, accumulation, checkpoint round trip included): the
    numbers stay Horovod's, and both ranks run the same path at every step."""
    found = run_ok("switch")
    _check_equal_runs(found, [("cnn-small", "sgd", 1), ("gpt2-small", "adamw", 1), ("cnn-small", "sgd", 2),
                              ("cnn-small", "adamw", 1)], switching=True)
    for first, second in zip(found[0]["runs"], found[1]["runs"]):
        modes = first["modes"]
        assert modes == second["modes"], (modes, second["modes"])
        # 30 steps (and the step of broadcast_optimizer_state): warm-up, the scheduled trial, the plain one.
        assert len(modes) == 30 + first["idiom"] and modes.startswith("sssssp"), modes
        assert "p" in modes and modes.count("sp") + modes.count("ps") >= 4, modes
        # Horovod's own path is run by the user's hvd.DistributedOptimizer itself: its gradient
        # hooks launch the all-reduces in exactly the plain steps' backward passes, never in the
        # scheduled ones (a plain torch optimizer has no such hooks: our reducer runs that path).
        for run in (first, second):
            training = run["modes"][-len(run["horovod_hooks"]):]
            expected = "".join("h" if mode == "p" and not run["plain"] else "-" for mode in training)
            assert run["horovod_hooks"] == expected, (run["modes"], run["horovod_hooks"])


def test_auto_tuning_keeps_the_numbers():
    found = run_ok("tune")
    _check_equal_runs(found, [("cnn-small", "sgd", 1)])
    # Rank 0 decides every piece, so only rank 0 tunes; rank 1 replays its pieces.
    assert found[1]["runs"][0]["tuning"] is None
    tuning = found[0]["runs"][0]["tuning"]
    assert tuning["done"], tuning
    # The start (16 KiB) is the smallest partition allowed here, so at least one move up is tried.
    assert len({p for p, _ in tuning["settings"]}) >= 2, tuning


def test_credit_with_ranks_ready_in_different_orders_equals_horovod():
    """A credit is safe because rank 0 decides: with each rank choosing its own pieces, rank 1's
    late gradients made the two ranks fill their credits with different pieces (a deadlock)."""
    found = run_ok("credit")
    _check_equal_runs(found, [("cnn-small", "sgd", 1), ("gpt2-small", "sgd", 1)])
    for run in found[0]["runs"]:
        assert run["credit_bytes"] == 64 * 1024
        assert run["stats"]["peak_in_flight_bytes"] <= 64 * 1024, run["stats"]
    assert {run["channel"] for rank in (0, 1) for run in found[rank]["runs"]} == {"TcpOrderChannel"}


def test_order_falls_back_to_horovod_broadcasts_on_every_rank():
    """A rank that cannot reach rank 0 by TCP: all ranks agree on Horovod broadcasts, same numbers."""
    found = run_ok("fallback")
    _check_equal_runs(found, [("cnn-small", "sgd", 1)])
    assert [found[rank]["runs"][0]["channel"] for rank in (0, 1)] == ["HorovodOrderChannel"] * 2


def test_two_scheduled_optimizers_in_one_process():
    """A GAN has two optimizers: each steps while the other's gradients may be in flight."""
    code, stdout, stderr, _ = horovodrun("two")
    found = results(stdout)
    assert sorted(found) == [0, 1], f"exit code {code}\n{stdout[-4000:]}\n{stderr[-4000:]}"
    for rank, result in found.items():
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        for run in result["runs"]:
            assert run["max_abs_diff"] == 0.0, (rank, run)
    assert code == 0, stderr[-4000:]


_bad_results: Dict[int, dict] = {}


def _bad() -> Dict[int, dict]:
    """The ``bad`` scenario, run once for the tests that read it."""
    if not _bad_results:
        _bad_results.update(run_ok("bad"))
    return _bad_results


def test_unsupported_settings_raise_clear_value_errors():
    for rank, result in _bad().items():
        errors = result["errors"]
        for case, word in (("compression", "compression"), ("op", "op="), ("adasum", "op="),
                           ("groups", "groups"), ("merge", "merge")):
            error = errors[case]
            assert error is not None, f"rank {rank}: {case} was accepted"
            assert error["type"] == "ValueError", (rank, case, error)
            assert word in error["message"].lower(), (rank, case, error)


def test_hvd_join_with_two_scheduled_optimizers_open_is_a_clear_error_and_with_one_joins():
    results = _bad()
    error = results[1]["errors"]["join"]
    assert error is not None, "hvd.join() with two ScheduledOptimizers open was accepted"
    assert error["type"] == "JoinUnsupported", error
    assert "rank 1" in error["message"] and "drop_last=True" in error["message"], error
    for rank, result in results.items():
        joined = result["errors"]["join-one-open"]
        assert joined["ours"] and joined["last"] in (0, 1), (rank, joined)
        after = result["errors"]["join-after-close"]
        assert after["restored"], f"rank {rank}: hvd.join is still bytescheduler's after close()"
        assert after["last"] in (0, 1), (rank, after)


def test_sparse_gradients_are_refused_at_construction_with_the_fix():
    for rank, result in _bad().items():
        error = result["errors"]["sparse"]
        assert error is not None and error["type"] == "GradientError", (rank, error)
        assert "['0.weight']" in error["message"] and "sparse=False" in error["message"], (rank, error)


def test_a_second_backward_before_step_is_an_error_on_horovods_own_path_too():
    for rank, result in _bad().items():
        error = result["errors"]["second"]
        assert error is not None and error["type"] == "GradientError", (rank, error)
        assert "backward_passes_per_step=k" in error["message"] and error["mode"] == "plain", (rank, error)


def test_wrapping_a_scheduled_optimizer_again_raises():
    """Like bytescheduler.pytorch.ScheduledOptimizer, which raises TypeError("... already wrapped ...")."""
    for rank, result in _bad().items():
        error = result["errors"]["twice"]
        assert error is not None, f"rank {rank}: a scheduled optimizer was wrapped again without an error"
        assert error["type"] == "TypeError" and "already wrapped" in error["message"], (rank, error)


def test_peer_death_under_horovodrun_ends_the_job_fast():
    code, stdout, stderr, seconds = horovodrun("dies")
    output = stdout + stderr
    assert code != 0, output[-4000:]
    # Not a hang: far below the 180 s deadline; startup plus a few steps, plus horovodrun's
    # 5 s grace period when it terminates the survivor.
    assert seconds < 60, f"took {seconds:.1f} s"
    assert "DYING" in stdout, output[-4000:]
    assert "Process 1 exit with status code 17" in stdout, output[-4000:]
    assert "Exit code: 17" in stderr, output[-4000:]
    # horovodrun terminates rank 0 as soon as rank 1 fails; whether rank 0 reported its
    # error before that is a race. When it did, the error is bytescheduler's, and fast.
    found = results(stdout)
    assert 1 not in found
    if 0 in found:
        _check_rank0_error(found[0])


def test_peer_death_rank0_raises_without_horovodrun_kill_all():
    """The same ranks, started with Horovod's rendezvous server but nobody killing rank 0."""
    codes, stdout, seconds = _launch_without_kill_all("dies")
    assert codes == [3, 17], f"exit codes {codes}\n{stdout[-4000:]}"  # 3: the worker caught the error
    assert seconds < 60, f"took {seconds:.1f} s"
    found = results(stdout)
    assert sorted(found) == [0], stdout[-4000:]
    _check_rank0_error(found[0])


def test_a_peer_that_stops_training_on_horovods_own_path_is_a_timeout_not_a_hang():
    """Horovod's synchronize would wait for it forever; our deadline holds while it waits."""
    from tests.horovod_worker import STALL_SECONDS, STALL_TIMEOUT

    codes, stdout, seconds = _launch_without_kill_all("stalls")
    assert codes == [3, 0], f"exit codes {codes}\n{stdout[-4000:]}"  # 3: rank 0 caught the error
    found = results(stdout)
    rank0 = found[0]
    assert rank0["raised"] and rank0["type"] == "CommunicationTimeout", rank0
    assert "an all-reduce of Horovod's own path did not finish within 3.0 s" in rank0["message"], rank0
    assert "BYTESCHEDULER_TIMEOUT" in rank0["message"] and rank0["step"] == 3, rank0
    assert STALL_TIMEOUT <= rank0["elapsed"] < STALL_SECONDS - 2, rank0  # the deadline, not the peer's return
    assert "bytescheduler-hvd-sync-r0" in rank0["threads"], rank0  # the wait ran on its thread
    assert found[1] == dict(found[1], raised=False, step=3), found


@pytest.mark.parametrize("dies_after", [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
def test_peer_killed_while_pieces_are_enqueued_is_an_error_not_a_hang(dies_after):
    """Horovod's background loop, dying, finalizes the queued operations under its process-set
    lock while our launching thread enqueues more under the GIL: before horovod_hold.py each
    could wait for the other forever (chaos trial 135). Without the fix 1 trial of 5 hung in
    each of two runs (a stand-alone script of the same kind: 5 of 13), so these 8 catch a
    regression most of the time, not always; with it none hung in 39 tries."""
    codes, stdout, seconds = _launch_without_kill_all("dies_enqueueing", timeout=90,
                                                      env={"DIES_AFTER": str(dies_after)})
    assert codes == [3, -signal.SIGKILL], f"exit codes {codes} after {seconds:.0f} s\n{stdout[-4000:]}"
    (result,) = results(stdout).values()
    assert result["errors"] and "HorovodInternalError" in result["errors"][0], result
    assert result["launcher_ended"], result


def _check_rank0_error(result: dict) -> None:
    assert result["raised"], result
    assert (result["module"], result["type"]) == ("bytescheduler.core.errors", "CommunicationError"), result
    # Whichever notices first: Horovod's failed all-reduce, or the ordering connection rank 1 left.
    assert "HorovodInternalError" in result["message"] or "left the ordering channel" in result["message"], result
    # Raised in step 3 (its gradients never complete), or in step 4's forward, which waits for them.
    assert result["step"] in (3, 4), result
    # Horovod reports the dead peer at once; bytescheduler does not wait for its own timeout.
    assert 0 <= result["elapsed"] < DIES_TIMEOUT, result


def _launch_without_kill_all(scenario: str, timeout: float = TIMEOUT,
                             env: Dict[str, str] = None) -> Tuple[List[int], str, float]:
    """Start 2 ranks as horovodrun --gloo does (rendezvous server, HOROVOD_* variables), minus kill-all."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(False)
    plan = get_host_assignments(parse_hosts("localhost:2"), 2)
    port = server.start()
    processes: List[subprocess.Popen] = []
    started = time.monotonic()
    try:
        server.init(plan)
        for slot in plan:
            rank_env = dict(_env(), **(env or {}))
            rank_env.update({
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": "lo",
                "HOROVOD_HOSTNAME": slot.hostname,
                "HOROVOD_RANK": str(slot.rank),
                "HOROVOD_SIZE": str(slot.size),
                "HOROVOD_LOCAL_RANK": str(slot.local_rank),
                "HOROVOD_LOCAL_SIZE": str(slot.local_size),
                "HOROVOD_CROSS_RANK": str(slot.cross_rank),
                "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            })
            processes.append(subprocess.Popen(
                [sys.executable, WORKER, scenario], cwd=ROOT, env=rank_env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            ))
        outputs = []
        for rank, process in enumerate(processes):
            remaining = max(1.0, timeout - (time.monotonic() - started))
            outputs.append(_communicate(process, remaining, f"rank {rank} of {scenario}")[0])
        return [p.returncode for p in processes], "\n".join(outputs), time.monotonic() - started
    finally:
        for process in processes:
            if process.poll() is None:
                _kill(process)
        server.stop()


def test_settings_on_one_rank_only_come_from_rank_0_and_the_numbers_stay_horovods():
    found = run_ok("settings")
    assert found[0]["config"] == found[1]["config"], found
    assert found[1]["config"]["timeout"] == 300.0 and not found[1]["config"]["auto_tune"], found
    for rank in (0, 1):
        assert found[rank]["max_abs_diff"] == 0.0, found[rank]
    text = "\n".join(found[1]["warnings"])
    for variable in ("BYTESCHEDULER_TIMEOUT", "BYTESCHEDULER_PARTITION", "BYTESCHEDULER_TUNING",
                     "BYTESCHEDULER_ADAPTIVE", "BYTESCHEDULER_CYCLE_TIME"):
        assert variable in text, text
    assert not found[0]["warnings"], found[0]


def test_a_model_that_differs_is_refused_on_every_rank_naming_the_parameter():
    found = run_ok("layout")
    for rank in (0, 1):
        messages = found[rank]["messages"]
        assert "'1.weight' of shape (2, 8), float32 on rank 0 but '1.weight' of shape (3, 8), float32 on rank 1" \
            in messages["shape"], messages
        assert "rank 0 has 4 parameters, rank 1 has 6; rank 1 has '2.weight'" in messages["count"], messages


@pytest.mark.parametrize("ranks", [3, 4, 8])
def test_many_ranks_of_different_speeds_one_joining_late_average_as_horovod(ranks):
    """Each step's averaged gradients within 1e-6 of Horovod's, from the same parameters
    (beyond 2 ranks the sum order depends on the operation boundaries), and every rank
    holds the same model; rank N-1 joins seconds late and every rank pauses at random."""
    code, stdout, stderr, _ = horovodrun("many", timeout=300, ranks=ranks)
    assert code == 0, f"exit code {code}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    found = results(stdout)
    assert sorted(found) == list(range(ranks)), stdout[-4000:]
    for config in ("pieces", "switching"):
        assert len({found[rank][config]["checksum"] for rank in found}) == 1, found
        for rank in found:
            assert found[rank][config]["worst"] <= 1e-6, (config, rank, found[rank][config])


_surface_results: Dict[int, dict] = {}


def _surface() -> Dict[int, dict]:
    """The ``surface`` scenario, run once for the tests that read it."""
    if not _surface_results:
        _surface_results.update(run_ok("surface"))
    return _surface_results


def _check_same_as_horovod(name: str) -> None:
    """The run ``name`` of every rank trained bit for bit as hvd.DistributedOptimizer alone."""
    found = _surface()
    for rank, result in found.items():
        run = result["runs"][name]
        assert run["max_abs_diff"] == 0.0 and run["values_equal"], (rank, name, run)
        assert run["operations"] > 0, (rank, name, run)
    assert found[0]["runs"][name]["checksum"] == found[1]["runs"][name]["checksum"], name


CLIPPED = ("clip", "clip-adamw-accumulate", "clip-gpt2", "clip-switch", "clip-unused-on-rank-1",
           "clip-unused-accumulate")


@pytest.mark.parametrize("name", CLIPPED)
def test_horovods_clipping_idiom_equals_horovod_bit_for_bit(name):
    """optimizer.synchronize(); clip_grad_norm_(...); with optimizer.skip_synchronize(): optimizer.step(),
    on the schedule and (``clip-switch``) switching to Horovod's own path; with accumulation, and
    with a branch left out on rank 1 (synchronize() averages zeros for it there, as Horovod's)."""
    from tests.horovod_worker import MAX_NORM

    _check_same_as_horovod(name)
    for rank, result in _surface().items():
        run = result["runs"][name]
        assert run["warnings"] == [[], []], (rank, name, run["warnings"])  # neither warns
        assert any(norm > MAX_NORM for _, norm in run["values"]), (rank, name, run["values"])  # it clipped
        if name == "clip-switch":
            assert "s" in run["modes"] and "p" in run["modes"], run["modes"]


def test_step_right_after_synchronize_warns_once_as_horovod_does():
    _check_same_as_horovod("warn")
    _check_same_as_horovod("checkpoint")
    for rank, result in _surface().items():
        horovods, ours = result["runs"]["warn"]["warnings"]
        # Four such steps, one warning each: Python's default filter shows a warning once per place.
        assert len(horovods) == 1 and "skip_synchronize" in horovods[0], horovods
        assert len(ours) == 1 and "synchronize()" in ours[0] and "skip_synchronize()" in ours[0], ours
        # load_state_dict() between synchronize() and step() clears the flag, as Horovod's does.
        assert result["runs"]["checkpoint"]["warnings"] == [[], []], result["runs"]["checkpoint"]


@pytest.mark.parametrize("name", ["zero-grad", "zero-grad-accumulate"])
def test_zero_grad_between_backward_and_step_is_refused_as_horovod_refuses_it(name):
    """An AssertionError, as Horovod's; after synchronize() it is allowed (a step dropped)."""
    _check_same_as_horovod(name)
    for rank, result in _surface().items():
        run = result["runs"][name]
        assert all(value[1] == ["AssertionError"] for value in run["values"]), (rank, run["values"])
        assert sum(len(value) == 3 for value in run["values"]) == 2, run["values"]  # two steps dropped
        # The step after a dropped one follows a synchronize() without skip_synchronize(): both warn.
        assert [len(w) for w in run["warnings"]] == [1, 1], run["warnings"]


@pytest.mark.parametrize("name", ["sum", "predivide", "predivide-switch"])
def test_op_sum_and_gradient_predivide_factor_equal_horovod(name):
    _check_same_as_horovod(name)
    if name.endswith("switch"):
        modes = _surface()[0]["runs"][name]["modes"]
        assert "s" in modes and "p" in modes, modes


def test_horovods_attributes_setter_and_helper():
    for rank, result in _surface().items():
        surface = result["surface"]
        horovods, ours = surface["attributes"]
        assert ours == horovods, (rank, surface["attributes"])
        assert surface["duplicates"] == [["a", "b"], ["a", "b"]], surface["duplicates"]
        assert surface["has"] == ["find_duplicates", "load_state_dict", "set_backward_passes_per_step",
                                  "skip_synchronize", "synchronize", "zero_grad"], surface["has"]
        # The number in force is accepted; another is refused, naming how to get it.
        assert surface["set_passes"]["2"] is None, surface["set_passes"]
        message = surface["set_passes"]["3"]
        assert message and "backward_passes_per_step=3" in message and "close()" in message, message
        # ScheduledOptimizer(backward_passes_per_step=3) over Horovod's default of 1: the attribute says 3.
        assert surface["override_passes"] == 3, surface
        # ScheduledOptimizer(model, optimizer, num_steps), as the original: one FutureWarning naming the fix.
        found = surface["num_steps_warnings"]
        assert len(found) == 1 and found[0].startswith("FutureWarning") and "drop the argument" in found[0], found
