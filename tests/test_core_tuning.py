"""Auto-tuning: the hill climb on a synthetic step-time landscape, and the scheduler's reconfigure."""

from __future__ import annotations

import math
import random
from typing import Callable, List, Tuple

import pytest

from bytescheduler.core import Scheduler, SchedulerConfig
from bytescheduler.core.tuning import AutoTuner
from tests.fakes import WAIT, FakeBackend, make_task

MiB = 1024**2


class Clock:
    """A step time that depends on the setting the tuner applied, plus optional noise."""

    def __init__(self, cost: Callable[[int, int], float], noise: float = 0.0, seed: int = 0) -> None:
        self.now = 0.0
        self.cost = cost
        self.noise = noise
        self.rng = random.Random(seed)
        self.setting: Tuple[int, int] = (0, 0)
        self.applied: List[Tuple[int, int]] = []

    def __call__(self) -> float:
        return self.now

    def apply(self, partition: int, credit: int) -> None:
        self.setting = (partition, credit)
        self.applied.append(self.setting)

    def advance(self) -> None:
        self.now += self.cost(*self.setting) * (1.0 + self.rng.uniform(-self.noise, self.noise))


def run(tuner: AutoTuner, clock: Clock, steps: int = 1000) -> int:
    for step in range(steps):
        tuner.on_step()
        if tuner.done:
            return step
        clock.advance()
    raise AssertionError(f"the tuner did not finish within {steps} steps: {tuner.history}")


def bowl(best_partition: int, best_multiple: int) -> Callable[[int, int], float]:
    """Step time grows with the log-distance from the best setting."""
    def cost(partition: int, credit: int) -> float:
        multiple = credit / partition
        return 1.0 + 0.1 * abs(math.log2(partition / best_partition)) + 0.05 * abs(math.log2(multiple / best_multiple))
    return cost


@pytest.mark.parametrize("best_partition, best_multiple", [(32 * MiB, 4), (512 * 1024, 1), (4 * MiB, 16), (4 * MiB, 4)])
def test_climbs_to_the_best_setting(best_partition, best_multiple):
    clock = Clock(bowl(best_partition, best_multiple))
    clock.setting = (4 * MiB, 16 * MiB)
    tuner = AutoTuner(4 * MiB, 16 * MiB, clock.apply, settle_steps=2, measure_steps=4, clock=clock)
    run(tuner, clock)
    assert tuner.result == (best_partition, best_partition * best_multiple)
    assert clock.applied[-1] == tuner.result, "the chosen setting must be the one in place at the end"
    assert tuner.best.seconds_per_step == pytest.approx(1.0)
    # Every measured setting was measured once.
    settings = [(t.partition_bytes, t.credit_bytes) for t in tuner.history]
    assert len(settings) == len(set(settings))


def test_flat_landscape_keeps_the_starting_setting_after_few_trials():
    clock = Clock(lambda p, c: 1.0)
    clock.setting = (4 * MiB, 16 * MiB)
    tuner = AutoTuner(4 * MiB, 16 * MiB, clock.apply, settle_steps=1, measure_steps=3, clock=clock)
    steps = run(tuner, clock)
    assert tuner.result == (4 * MiB, 16 * MiB)
    assert len(tuner.history) == 5  # start + one neighbour in each of 4 directions
    assert steps <= 5 * (1 + 3) + 1


def test_noise_below_the_threshold_does_not_move_the_setting():
    clock = Clock(lambda p, c: 1.0, noise=0.005, seed=3)
    clock.setting = (4 * MiB, 16 * MiB)
    tuner = AutoTuner(4 * MiB, 16 * MiB, clock.apply, settle_steps=1, measure_steps=5, threshold=0.02, clock=clock)
    run(tuner, clock)
    assert tuner.result == (4 * MiB, 16 * MiB)


def test_noisy_bowl_still_finds_a_good_setting():
    cost = bowl(16 * MiB, 2)
    clock = Clock(cost, noise=0.01, seed=1)
    clock.setting = (4 * MiB, 16 * MiB)
    tuner = AutoTuner(4 * MiB, 16 * MiB, clock.apply, settle_steps=1, measure_steps=7, clock=clock)
    run(tuner, clock)
    assert cost(*tuner.result) <= 1.06


def test_search_stays_in_its_box():
    clock = Clock(lambda p, c: 1.0 / p)  # bigger is always better
    clock.setting = (4 * MiB, 16 * MiB)
    tuner = AutoTuner(4 * MiB, 16 * MiB, clock.apply, settle_steps=0, measure_steps=1,
                      max_partition_bytes=64 * MiB, clock=clock)
    run(tuner, clock)
    assert tuner.result[0] == 64 * MiB
    assert all(p <= 64 * MiB for p, _ in clock.applied)


def test_settle_steps_are_not_measured():
    # The first step after every switch is slow (old pieces drain): it must not count.
    state = {"fresh": False}

    def cost(partition, credit):
        slow = state["fresh"]
        state["fresh"] = False
        return (100.0 if slow else 1.0) + (0.0 if partition == 8 * MiB else 0.5)

    clock = Clock(cost)
    clock.setting = (4 * MiB, 16 * MiB)

    def apply(partition, credit):
        clock.apply(partition, credit)
        state["fresh"] = True

    tuner = AutoTuner(4 * MiB, 16 * MiB, apply, settle_steps=1, measure_steps=3, clock=clock)
    run(tuner, clock)
    assert tuner.result[0] == 8 * MiB
    assert all(t.seconds_per_step < 2.0 for t in tuner.history)


def test_agree_makes_every_rank_follow_rank_0():
    # Two "ranks" whose own clocks disagree; both use rank 0's measurement.
    costs = [bowl(16 * MiB, 4), bowl(1 * MiB, 1)]
    clocks = [Clock(c) for c in costs]
    shared: List[float] = []
    tuners = []
    for rank, clock in enumerate(clocks):
        clock.setting = (4 * MiB, 16 * MiB)

        def agree(value, rank=rank):
            if rank == 0:
                shared.append(value)
                return value
            return shared[-1]

        tuners.append(AutoTuner(4 * MiB, 16 * MiB, clock.apply, agree=agree, settle_steps=1, measure_steps=2,
                                clock=clock))
    for _ in range(500):
        for tuner, clock in zip(tuners, clocks):
            tuner.on_step()
            clock.advance()
        if tuners[0].done:
            break
    assert tuners[0].done and tuners[1].done
    assert tuners[0].result == tuners[1].result == (16 * MiB, 64 * MiB)
    assert clocks[0].applied == clocks[1].applied, "ranks must switch to the same settings at the same steps"


def test_bad_arguments():
    with pytest.raises(ValueError, match="measure_steps"):
        AutoTuner(1, 1, lambda p, c: None, measure_steps=0)


def test_config_from_environment_and_keyword():
    assert SchedulerConfig.resolve(environ={}).auto_tune is False
    assert SchedulerConfig.resolve(environ={"BYTESCHEDULER_TUNING": "1"}).auto_tune is True
    assert SchedulerConfig.resolve(environ={"BYTESCHEDULER_TUNING": "1"}, auto_tune=False).auto_tune is False
    with pytest.raises(ValueError, match="BYTESCHEDULER_TUNING"):
        SchedulerConfig.resolve(environ={"BYTESCHEDULER_TUNING": "maybe"})


def test_reconfigure_changes_pieces_of_later_tasks_and_the_credit():
    backend = FakeBackend("manual")
    scheduler = Scheduler(backend, partition_bytes=400, credit_bytes=400, merge=False, fast_lane_bytes=0)
    try:
        first = scheduler.submit(make_task(0, 200, itemsize=4))  # 800 B: two pieces of 400
        backend.wait_launched(1)
        assert scheduler.in_flight_bytes == 400  # the credit holds the second piece back
        scheduler.reconfigure(partition_bytes=200, credit_bytes=800)
        backend.wait_launched(2)  # the larger credit admits it now
        assert scheduler.in_flight_bytes == 800
        second = scheduler.submit(make_task(1, 200, itemsize=4))  # 800 B: four pieces of 200
        backend.release_until_done([first, second])
        sizes = {}
        for record in backend.ops:
            for key, _, start, stop in record.pieces:
                sizes.setdefault(key, []).append((stop - start) * 4)
        assert sizes == {0: [400, 400], 1: [200, 200, 200, 200]}
        assert scheduler.stats["partition_bytes"] == 200 and scheduler.stats["credit_bytes"] == 800
        assert max(r.in_flight_after for r in backend.ops) <= 800
    finally:
        scheduler.stop(wait=False)
        backend.close()


def test_scheduler_tunes_only_when_asked_and_only_on_the_deciding_rank():
    backend = FakeBackend("immediate")
    plain = Scheduler(backend)
    tuned = Scheduler(backend, auto_tune=True)
    try:
        assert plain.tuner is None
        assert tuned.tuner is not None and tuned.tuner.trial == (tuned.config.partition_bytes,
                                                                  tuned.config.credit_bytes)
        plain.step_boundary()  # costs nothing, does nothing
        for _ in range(200):
            tuned.step_boundary()
            tuned.submit(make_task(0, 1000)).result(timeout=WAIT)
            if tuned.tuner.done:
                break
        assert tuned.tuner.done
        assert (tuned.config.partition_bytes, tuned.config.credit_bytes) == tuned.tuner.result
    finally:
        plain.stop()
        tuned.stop()
