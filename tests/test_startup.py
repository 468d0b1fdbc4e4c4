"""The start-up prediction: which path the mode switch starts on after the warm-up.

The model (:mod:`bytescheduler.core.startup`) and the chooser's handling of a prediction
are tested alone with made-up steps and links; then, on 2 real gloo processes, the whole of
it (warm-up samples, the probe over the framework's own collective, the proposal) for
ScheduledOptimizer and the DDP hook: on loopback with an MLP (the framework's path is
predicted) and on a link shaped to 200 Mbit/s between two network namespaces with a model
whose large gradient the schedule can send during the next forward (the schedule is
predicted). Whichever path runs, parameters and losses equal DDP's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from bytescheduler.core.modes import CONTINUE, PLAIN, SCHEDULED, ModeChooser, ModeSwitchParams, decode, encode, \
    predicted_mode
from bytescheduler.core.startup import (
    LinkProbe,
    StartupPredictor,
    StepSample,
    plain_step,
    predict,
    probe_link,
    scheduled_step,
)
from bytescheduler_tools.bench.testbed import NamespaceTestbed
from tests.worker_ranks import assert_same_state, run_worker

MB = 1_000_000

# ------------------------------------------------------------------------- the model, alone


def test_the_frameworks_buckets_wait_for_their_last_gradient_and_the_bucket_before():
    link = LinkProbe(latency_s=0.0, seconds_per_byte=1e-8)  # 100 MB/s
    # 1 MB at once (the first bucket closes at 1 MiB... with the next), 30 MB at 0.1 s, 1 MB at the end (0.3 s)
    sample = StepSample(forward_s=0.1, backward_s=0.3, ready=[(0.0, MB), (0.1, 30 * MB), (0.3, MB)])
    step, exposed = plain_step(sample, link, first_bytes=MB, bucket_bytes=25 * MB)
    # buckets: [1 MB] sent at 0 (0.01 s), [30 MB] at 0.1 (until 0.4), [1 MB] after it (0.41)
    assert exposed == pytest.approx(0.11) and step == pytest.approx(0.51)
    # one bucket per gradient (0): the same here; one bucket for all: sent at the end
    assert plain_step(sample, link, 0, 0)[1] == pytest.approx(0.11)
    assert plain_step(sample, link, 100 * MB, 100 * MB)[1] == pytest.approx(0.32)
    # on a link twice as slow
    assert plain_step(sample, link, MB, 25 * MB, slower=2.0)[1] == pytest.approx(0.42)


def test_the_schedule_waits_for_what_backward_produced_last_or_for_the_whole_link():
    link = LinkProbe(latency_s=0.0, seconds_per_byte=1e-8)
    early = StepSample(0.1, 0.3, [(0.0, 30 * MB), (0.3, MB // 100)])
    assert scheduled_step(early, link) == pytest.approx(0.4 + 0.0001)  # compute (and the last, small gradient)
    tied = StepSample(0.1, 0.3, [(0.0, 5 * MB), (0.3, 10 * MB)])  # a tied embedding: its gradient comes last
    assert scheduled_step(tied, link) == pytest.approx(0.4 + 0.1)
    busy = StepSample(0.1, 0.3, [(0.0, 60 * MB), (0.3, MB)])
    assert scheduled_step(busy, link) == pytest.approx(0.61)  # the link: 61 MB at 100 MB/s


def test_a_slow_link_predicts_the_schedule_a_fast_one_the_framework_and_between_neither():
    step = StepSample(forward_s=0.2, backward_s=0.3, ready=[(0.0, 50 * MB), (0.3, 1000)])
    slow = predict(step, LinkProbe(0.001, 1e-8), measured_s=0.55)  # 0.5 s to send, overlapped by the schedule
    assert slow.mode == SCHEDULED and slow.plain_s > 1.1 * slow.scheduled_s
    fast = predict(step, LinkProbe(0.0001, 1e-11), measured_s=0.55)  # hidden in DDP's backward
    assert fast.mode == PLAIN and fast.exposed_s < 0.001  # the last bucket's fixed cost
    between = predict(step, LinkProbe(0.0001, 5e-9), measured_s=0.55)
    assert between.mode is None
    # measured: the schedule's own steps were slow (its CPU cost): the framework's path
    assert predict(step, LinkProbe(0.0001, 5e-9), measured_s=0.70).mode == PLAIN
    # ... and a schedule that the model favours but whose steps measured slower than the
    # framework's predicted step is not predicted
    assert predict(step, LinkProbe(0.001, 1e-8), measured_s=0.80).mode is None
    # the DDP hook: the schedule is never predicted
    assert predict(step, LinkProbe(0.001, 1e-8), measured_s=0.55, schedules=False).mode is None
    assert "scheduled" in slow.text() and "not sure" in between.text()


def test_the_probe_reads_the_fixed_cost_and_the_rate_of_one_all_reduce():
    clock = [0.0]
    calls = []

    def all_reduce(key, nbytes):  # 1 ms + 10 ns per byte, the first call 5 s (a late peer)
        calls.append((key, nbytes))
        clock[0] += 5.0 if not key else 0.001 + nbytes * 1e-8

    link = probe_link(all_reduce, gradient_bytes=100 * MB, clock=lambda: clock[0])
    assert link.latency_s == pytest.approx(0.001 + 4096 * 1e-8)
    assert link.seconds_per_byte == pytest.approx(1e-8)
    assert calls[0][0] == 0 and {n for _, n in calls[1:]} == {4096, 8 * 1024**2}
    # a model smaller than the large probe: the probe is at most its size (and 64 KiB at least)
    calls.clear()
    probe_link(all_reduce, gradient_bytes=100_000, clock=lambda: clock[0])
    assert max(n for _, n in calls) == 100_000
    calls.clear()
    probe_link(all_reduce, gradient_bytes=10, clock=lambda: clock[0])
    assert max(n for _, n in calls) == 64 * 1024


def test_the_predictor_probes_on_every_rank_and_predicts_on_rank_0_from_its_least_disturbed_step():
    probes = []
    follower = StartupPredictor(lambda key, nbytes: probes.append(nbytes), 10 * MB, leader=False)
    assert follower.probe() is None and probes  # probed all the same (collective)
    reports = []
    leader = StartupPredictor(lambda key, nbytes: None, 10 * MB, leader=True, report=reports.append)
    assert leader.probe() is None  # no warm-up sample: nothing to predict from
    leader.add(StepSample(0.5, 0.5, [(0.0, 10 * MB)]))
    leader.add(StepSample(0.2, 0.3, [(0.0, 10 * MB)]))
    leader.add(StepSample(0.1, 0.1, []))  # no gradient (a step without backward): not a sample
    predict_ = leader.probe()
    assert predict_ is not None
    predict_(0.6)
    assert reports == [leader.prediction] and leader.prediction.compute_s == pytest.approx(0.5)
    # a step the sampler timed whole (the hook's) is shorter than the mode switch's reading
    # (which counts the program's pause between two iterations): the shorter is the measure
    leader.add(StepSample(0.2, 0.3, [(0.0, 10 * MB)], period_s=0.55))
    predict_(5.0)
    assert leader.prediction.measured_s == 0.55


# ------------------------------------------------------------------------- the chooser


def _drive(chooser, seconds, steps, predicted=None, follower=None):
    """Run ``steps`` steps (seconds(mode) each); at the warm-up's end rank 0 predicts ``predicted``."""
    for _ in range(steps):
        chooser.record(seconds(chooser.mode))
        decision = chooser.end_step()
        if follower is not None:
            assert follower.end_step() == decision
        if decision:
            proposal = chooser.propose(lambda measured: predicted)
            chooser.adopt(proposal)
            if follower is not None:
                follower.adopt(proposal)
    return "".join(mode[0] for mode in chooser.history)


PARAMS = dict(warmup=3, settle=1, trial=4, pairs=3, hold=20, verify_hold=10, min_retrial=4, trial_seconds=0)


@pytest.mark.parametrize("predicted", [SCHEDULED, PLAIN])
def test_a_predicted_path_runs_from_the_warm_ups_end_and_its_retrial_confirms_it(predicted):
    faster = {SCHEDULED: 1.0, PLAIN: 1.3} if predicted == SCHEDULED else {SCHEDULED: 1.3, PLAIN: 1.0}
    chooser, follower = ModeChooser(ModeSwitchParams(**PARAMS)), ModeChooser(ModeSwitchParams(**PARAMS))
    _drive(chooser, faster.get, 60, predicted, follower)
    assert follower.history == chooser.history  # followers run what rank 0's proposal says
    chooser = ModeChooser(ModeSwitchParams(**PARAMS))
    first, other = predicted[0], ("p" if predicted == SCHEDULED else "s")
    # warm-up 3; the predicted path held 10 steps (after 1 to settle: a switch, or a drain of
    # the schedule); a re-trial of the other path 1+4, back 1+4: confirmed by a decisive
    # difference (23%), held as a decisive first choice, 4 x 20 (after a drain of the
    # schedule at that decision, 1+80), then the next re-trial
    hold = 80 + (predicted == SCHEDULED)
    history = _drive(chooser, faster.get, 130, predicted)
    assert history.startswith("sss" + first * 11 + other * 5 + first * (5 + hold) + other), history
    assert chooser.verdicts[1]["clear"]
    # a confirmation by less than a decisive difference: held as long as a verified choice
    close = {SCHEDULED: 1.0, PLAIN: 1.1} if predicted == SCHEDULED else {SCHEDULED: 1.1, PLAIN: 1.0}
    history = _drive(ModeChooser(ModeSwitchParams(**PARAMS)), close.get, 60, predicted)
    assert history.startswith("sss" + first * 11 + other * 5 + first * (5 + hold - 60) + other), history
    assert chooser.verdicts[0]["kind"] == "prediction" and chooser.verdicts[0]["winner"] == predicted
    assert chooser.verdicts[1]["kind"] == "re-trial" and chooser.verdicts[1]["winner"] == predicted


def test_a_wrong_prediction_is_undone_at_its_retrial():
    chooser = ModeChooser(ModeSwitchParams(**PARAMS))
    history = _drive(chooser, {SCHEDULED: 1.0, PLAIN: 1.3}.get, 40, PLAIN)  # the schedule is faster
    assert history.startswith("sss" + "p" * 11 + "s" * 5 + "p" * 5 + "s"), history
    assert chooser.mode == SCHEDULED


def test_without_a_prediction_the_trials_run_as_before():
    times = {SCHEDULED: 1.0, PLAIN: 1.3}.get
    unsure = _drive(ModeChooser(ModeSwitchParams(**PARAMS)), times, 80, None)
    chooser = ModeChooser(ModeSwitchParams(**PARAMS))
    for _ in range(80):  # as the chooser ran before predictions existed: propose() alone
        chooser.record(times(chooser.mode))
        if chooser.end_step():
            chooser.adopt(chooser.propose())
    assert unsure == "".join(mode[0] for mode in chooser.history)
    assert unsure.startswith("sss" + "s" * 5 + "p" * 5), unsure  # trials first


def test_a_prediction_travels_in_the_warm_ups_proposal_only():
    proposal = encode(CONTINUE, 37, SCHEDULED)
    assert decode(proposal) == (CONTINUE, 37) and predicted_mode(proposal) == SCHEDULED
    assert predicted_mode(encode(CONTINUE, 37)) is None
    chooser = ModeChooser(ModeSwitchParams(**PARAMS))
    _drive(chooser, {SCHEDULED: 1.0, PLAIN: 1.3}.get, 10, None)  # in the trials now
    with pytest.raises(ValueError, match="after the warm-up"):
        chooser.adopt(encode(CONTINUE, 4, PLAIN))


def test_predict_is_a_mode_switch_parameter_from_any_source():
    assert ModeSwitchParams().predict is True
    assert ModeSwitchParams.parse("predict=0").predict is False
    assert ModeSwitchParams.parse({"predict": "off"}).predict is False
    assert ModeSwitchParams.parse(ModeSwitchParams(predict=False).text()) == ModeSwitchParams(predict=False)
    with pytest.raises(ValueError, match="predict"):
        ModeSwitchParams.parse("predict=maybe")
    with pytest.raises(ValueError, match="below 4096"):
        ModeSwitchParams(max_trial=5000)


# ------------------------------------------------------------------------- 2 real processes

DEADLINE = 240.0


def _check(ranks):
    for rank, runs in enumerate(ranks):
        for system in ("optimizer", "hook"):
            run = runs[system]
            what = f"rank {rank}, {system}"
            assert_same_state(run["state"], runs["ddp"]["state"], what)
            assert all(torch.equal(a, b) for a, b in zip(run["losses"], runs["ddp"]["losses"])), what
            assert run["probed"], what  # every rank took part in the probe
            assert run["modes"] == ranks[0][system]["modes"], what  # every rank ran the same path
            assert run["predicted"] is (rank == 0), what  # rank 0 predicts
    return {system: (ranks[0][system]["prediction"], ranks[0][system]["modes"]) for system in ("optimizer", "hook")}


def test_on_loopback_an_mlp_starts_on_the_frameworks_path_with_ddps_numbers(tmp_path):
    seen = _check(run_worker("tests.startup_worker", "fast", tmp_path, DEADLINE))
    for system, (prediction, modes) in seen.items():
        assert prediction == PLAIN, (system, prediction)
        assert modes.startswith("sss") and set(modes[3:]) == {"p"}, (system, modes)  # no trial of the schedule


def test_on_a_slow_link_the_schedule_runs_from_the_warm_ups_end_with_ddps_numbers(tmp_path):
    with NamespaceTestbed(2, "200mbit") as net:
        ranks = run_worker("tests.startup_worker", "slow", tmp_path, DEADLINE, testbed=net)
    seen = _check(ranks)
    prediction, modes = seen["optimizer"]
    assert prediction == SCHEDULED and set(modes) == {"s"}, seen  # no trial of the framework's path
    assert seen["hook"][0] is None  # the hook: not predicted, its trials run (both paths)
    assert "p" in seen["hook"][1], seen

