"""The mode switch's choosing cost over a training (:mod:`bytescheduler_tools.sim.choosing`).

The bench times 60 to 640 steps, where the switch's first trials weigh most; these tests
hold the real :class:`~bytescheduler.core.modes.ModeChooser` to what a training of
thousands of steps pays for choosing, so that a change of its phases or holds that makes
long trainings pay more fails here.
"""

from __future__ import annotations

import doctest

import pytest

from bytescheduler.core.modes import ModeChooser, ModeSwitchParams
from bytescheduler_tools.sim import choosing


def test_the_docstring_examples_run():
    result = doctest.testmod(choosing)
    assert result.failed == 0 and result.attempted > 0, result


@pytest.mark.parametrize("step_seconds", [0.017, 0.11, 1.0])
@pytest.mark.parametrize("speedup", [0.67, 1.35])
def test_a_long_training_pays_little_for_choosing_whichever_path_is_faster(step_seconds, speedup):
    cost = choosing.choosing_cost(step_seconds, speedup, steps=(60, 1000, 10_000), noise=0.03, seed=1)
    # Measured with the chooser of 2026-11-29: 0.2-0.4% at 10,000 steps, 0.7-1.8% at 1,000.
    assert cost[10_000] < 0.005, cost
    assert cost[1000] < 0.025, cost
    assert cost[10_000] < cost[1000] < cost[60], cost


def test_on_a_noisy_machine_a_slightly_slower_schedule_does_not_stay_for_good():
    # Steps 10% noisy, slow ones in runs: an eight-step re-trial could switch to a schedule 5%
    # slower, which then stayed (5% lost for the whole training in 3 of 60 simulated runs,
    # before the twenty-sixth round's rule that it must lead again).
    costs = [choosing.choosing_cost(0.11, 0.95, steps=(10_000,), noise=0.10, correlation=0.7, seed=seed)[10_000]
             for seed in range(20)]
    assert max(costs) < 0.015, costs


def test_a_chooser_that_never_stops_trying_the_slower_path_is_caught():
    # Holds that stay at 20 steps re-try a 1.5x slower schedule for 8 of every 36 steps.
    stubborn = ModeChooser(ModeSwitchParams(hold=20, max_hold=20, verify_hold=20))
    cost = choosing.choosing_cost(0.11, 0.67, steps=(10_000,), seed=1, chooser=stubborn)
    assert cost[10_000] > 0.05, cost


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="speedup"):
        choosing.choosing_cost(0.1, 0.0)
    with pytest.raises(ValueError, match="step counts"):
        choosing.choosing_cost(0.1, 1.1, steps=(0,))


def test_a_sure_start_up_prediction_saves_the_first_steps_and_a_wrong_one_is_undone():
    steps = (13, 60, 10_000)
    for step_seconds, speedup in ((1.0, 1.35), (0.11, 0.67)):
        trials = choosing.choosing_cost(step_seconds, speedup, steps=steps, seed=2)
        sure = choosing.choosing_cost(step_seconds, speedup, steps=steps, seed=2, prediction="sure")
        wrong = choosing.choosing_cost(step_seconds, speedup, steps=steps, seed=2, prediction="wrong")
        # the warm-up's 3 steps run the schedule either way; after them no trial of the slower path
        assert sure[13] < trials[13] / 2 and sure[60] < trials[60], (speedup, sure, trials)
        assert sure[10_000] <= trials[10_000] * 1.05, (speedup, sure, trials)  # no dearer in the long run
        assert wrong[60] > trials[60] and wrong[10_000] < 0.01, (speedup, wrong)  # the re-trial undoes it
    # within the model's margin the prediction says nothing: the trials run as without it
    assert choosing.choosing_cost(0.11, 1.05, seed=2, prediction="sure") == choosing.choosing_cost(0.11, 1.05, seed=2)
    with pytest.raises(ValueError, match="prediction"):
        choosing.choosing_cost(0.1, 1.1, prediction="maybe")
