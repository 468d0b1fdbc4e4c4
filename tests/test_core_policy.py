"""The pure parts of the core, driven with a fake clock: no threads, no sleeps.

:class:`SchedulingPolicy` (what rank 0 decides), :class:`Follower` (how the others replay
it) and :class:`Ledger` (what is pending, what is in flight) are fed events with the time
passed in; every test here is deterministic.
"""

from __future__ import annotations

import doctest
import importlib
import random
from typing import List, Tuple

import pytest

from bytescheduler.core import MismatchError, Operation, Task
from bytescheduler.core.follower import Follower
from bytescheduler.core.policy import SchedulingPolicy
from bytescheduler.core.ledger import Ledger
from bytescheduler.core.ordering import read_frame, to_frames


def task(key, numel, priority=0, itemsize=1, fuse_key="f32") -> Task:
    return Task(key=key, numel=numel, itemsize=itemsize, priority=priority, payload=None, fuse_key=fuse_key)


def shape(ops: List[Operation]) -> List[Tuple[int, List[Tuple[int, int, int]]]]:
    """(lane, [(key, start, stop), ...]) of each operation."""
    return [(op.lane, [(p.task.key, p.start, p.stop) for p in op.pieces]) for op in ops]


def finish(policy: SchedulingPolicy, ops: List[Operation]) -> None:
    for op in ops:
        policy.finished(op)


# ---------------------------------------------------------------------------- order, partition, merge


def test_most_urgent_first_then_first_come_first_served():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=10_000, merge=False)
    for key, priority in enumerate([3, 1, 2, 1, 0]):
        policy.add(task(key, 10, priority), now=0.0)
    assert [op.pieces[0].task.key for op in policy.decide(now=0.0)] == [4, 1, 3, 2, 0]


def test_large_tasks_become_contiguous_pieces_of_at_most_partition_bytes():
    policy = SchedulingPolicy(partition_bytes=40, credit_bytes=10_000, merge=False)
    policy.add(task(0, 25, itemsize=4), now=0.0)
    assert shape(policy.decide(now=0.0)) == [(0, [(0, 0, 10)]), (0, [(0, 10, 20)]), (0, [(0, 20, 25)])]


def test_small_neighbours_of_one_fuse_key_merge_up_to_partition_bytes():
    policy = SchedulingPolicy(partition_bytes=30, credit_bytes=10_000)
    for key in range(4):
        policy.add(task(key, 10, priority=key), now=0.0)
    policy.add(task(9, 5, priority=0.5, fuse_key="f16"), now=0.0)  # another dtype sits between
    assert shape(policy.decide(now=0.0)) == [(0, [(0, 0, 10)]), (0, [(9, 0, 5)]), (0, [(1, 0, 10), (2, 0, 10), (3, 0, 10)])]


def test_without_merge_or_fuse_key_nothing_merges():
    for merge, fuse_key in [(False, "f32"), (True, None)]:
        policy = SchedulingPolicy(partition_bytes=100, credit_bytes=10_000, merge=merge)
        for key in range(3):
            policy.add(task(key, 10, fuse_key=fuse_key), now=0.0)
        assert len(policy.decide(now=0.0)) == 3


# ---------------------------------------------------------------------------- credit and preemption


def test_credit_bounds_bytes_in_flight_and_completion_frees_it():
    policy = SchedulingPolicy(partition_bytes=10, credit_bytes=25, merge=False)
    policy.add(task(0, 60), now=0.0)
    first = policy.decide(now=0.0)
    assert [op.nbytes for op in first] == [10, 10] and policy.main.in_flight == 20
    assert policy.decide(now=0.0) == [] and not policy.can_launch(now=0.0)
    policy.finished(first[0])
    assert policy.wake_on_completion(now=0.0)
    assert [op.nbytes for op in policy.decide(now=0.0)] == [10]


def test_one_piece_larger_than_the_credit_goes_alone_when_nothing_is_in_flight():
    policy = SchedulingPolicy(partition_bytes=1000, credit_bytes=100, merge=False)
    policy.add(task(0, 500), now=0.0)
    policy.add(task(1, 50), now=0.0)
    ops = policy.decide(now=0.0)
    assert shape(ops) == [(0, [(0, 0, 500)])]
    policy.finished(ops[0])
    assert shape(policy.decide(now=0.0)) == [(0, [(1, 0, 50)])]


def test_a_later_urgent_task_overtakes_the_queued_pieces_of_an_earlier_one():
    policy = SchedulingPolicy(partition_bytes=10, credit_bytes=10, merge=False)
    policy.add(task(0, 40, priority=5), now=0.0)
    ops = policy.decide(now=0.0)
    assert shape(ops) == [(0, [(0, 0, 10)])]
    policy.add(task(1, 10, priority=0), now=0.001)
    policy.finished(ops[0])
    assert shape(policy.decide(now=0.002)) == [(0, [(1, 0, 10)])]


def test_an_earlier_iteration_goes_before_any_more_urgent_task_of_a_later_one():
    # Rank 0 skipped layer 2 in iteration 2: its zeros of iteration 1 are still queued when
    # iteration 2's more urgent gradients arrive; a rank that uses layer 2 in iteration 2
    # waits for those zeros before it can join iteration 2's operations.
    policy = SchedulingPolicy(partition_bytes=10, credit_bytes=10, merge=False)
    policy.add(task(0, 10, priority=0), now=0.0)
    first = policy.decide(now=0.0)
    policy.add(task(2, 20, priority=2), now=0.0)
    later = [task(0, 10, priority=0), task(1, 10, priority=1)]
    for t in later:
        t.iteration = 1
        policy.add(t, now=0.001)
    order = []
    ops = first
    while ops:
        finish(policy, ops)
        ops = policy.decide(now=0.002)
        order += [(p.task.iteration, p.task.key, p.start) for op in ops for p in op.pieces]
    assert order == [(0, 2, 0), (0, 2, 10), (1, 0, 0), (1, 1, 0)]


def test_no_operation_merges_two_iterations():
    # The zeros of iteration 1 for a layer rank 0 skipped, and iteration 2's gradients: another
    # rank can submit some of iteration 2's only after iteration 1's are averaged there, so an
    # operation holding both could never complete on it.
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=1000, merge=True)
    zeros = task(4, 10, priority=2)
    zeros.iteration = 1
    policy.add(zeros, now=0.0)
    for key in (0, 1):
        later = task(key, 10, priority=key)
        later.iteration = 2
        policy.add(later, now=0.0)
    assert shape(policy.decide(now=0.0)) == [(0, [(4, 0, 10)]), (0, [(0, 0, 10), (1, 0, 10)])]


def test_a_hold_keeps_later_iterations_back_until_every_hold_is_released():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=1000, merge=True)
    policy.hold(1)
    policy.hold(1)
    now = task(0, 10, priority=5)
    now.iteration = 1
    policy.add(now, now=0.0)
    later = task(1, 10, priority=0)
    later.iteration = 2
    policy.add(later, now=0.0)
    assert shape(policy.decide(now=0.0)) == [(0, [(0, 0, 10)])]  # its own iteration goes, merging nothing later
    assert not policy.can_launch(now=0.0) and policy.decide(now=0.0) == []
    assert policy.release(1) is False  # one hold is left
    assert policy.decide(now=0.0) == []
    assert policy.release(1) is True
    assert shape(policy.decide(now=0.0)) == [(0, [(1, 0, 10)])]


def test_credit_changes_take_effect_at_once_and_partition_for_new_tasks():
    policy = SchedulingPolicy(partition_bytes=10, credit_bytes=10, merge=False)
    policy.add(task(0, 30), now=0.0)
    assert len(policy.decide(now=0.0)) == 1
    policy.reconfigure(partition_bytes=20, credit_bytes=30)
    policy.add(task(1, 40, priority=1), now=0.0)
    assert [op.nbytes for op in policy.decide(now=0.0)] == [10, 10]  # the queued pieces keep their size
    assert policy.decide(now=0.0) == []  # 30 in flight
    policy.main.release(20)
    assert [op.nbytes for op in policy.decide(now=0.0)] == [20]  # 10 + 20 fits the new credit of 30


# ---------------------------------------------------------------------------- fast lane


def test_small_operations_take_the_fast_lane_with_its_own_window():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=100, merge=False, fast_lane_bytes=8, lanes=2)
    policy.add(task(0, 100, priority=5), now=0.0)
    policy.add(task(1, 4, priority=9), now=0.0)
    policy.add(task(2, 8, priority=9), now=0.0)
    assert shape(policy.decide(now=0.0)) == [(0, [(0, 0, 100)]), (1, [(1, 0, 4)])]
    assert policy.main.in_flight == 100 and policy.fast.in_flight == 4


def test_an_urgent_large_piece_takes_the_idle_fast_lane_past_less_urgent_main_work():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=100, merge=False, fast_lane_bytes=8, lanes=2)
    policy.add(task(0, 100, priority=5), now=0.0)
    assert len(policy.decide(now=0.0)) == 1
    policy.add(task(1, 50, priority=0), now=0.0)  # more urgent than what fills the main lane
    policy.add(task(2, 50, priority=9), now=0.0)  # less urgent: waits for the main credit
    assert shape(policy.decide(now=0.0)) == [(1, [(1, 0, 50)])]


def test_one_lane_or_fast_lane_off_means_everything_on_lane_0():
    for lanes, fast in [(1, 8), (2, 0)]:
        policy = SchedulingPolicy(partition_bytes=100, credit_bytes=1000, fast_lane_bytes=fast, lanes=lanes)
        policy.add(task(0, 4), now=0.0)
        assert policy.fast is None and [op.lane for op in policy.decide(now=0.0)] == [0]


# ---------------------------------------------------------------------------- cycle (holding work to merge)


def test_a_cycle_holds_small_work_until_it_ends_then_merges_it():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=1000, cycle_seconds=0.002)
    assert policy.add(task(0, 10), now=1.000)  # a hold begins: its driver must time it
    assert policy.decide(now=1.001) == [] and policy.hold_remaining(now=1.001) == pytest.approx(0.001)
    policy.add(task(1, 10), now=1.0015)
    assert shape(policy.decide(now=1.002)) == [(0, [(0, 0, 10), (1, 0, 10)])]


def test_a_full_operation_or_the_end_of_the_burst_or_draining_is_never_held():
    policy = SchedulingPolicy(partition_bytes=20, credit_bytes=1000, cycle_seconds=10.0)
    policy.add(task(0, 20), now=0.0)
    assert len(policy.decide(now=0.0)) == 1  # a whole partition's worth is queued
    policy.add(task(1, 5), now=0.0)
    assert policy.decide(now=0.0) == []
    assert policy.end_burst() and not policy.end_burst()  # the second call changes nothing
    assert len(policy.decide(now=0.0)) == 1
    policy.add(task(2, 5), now=0.0)  # the queue emptied: a new cycle holds again
    assert policy.decide(now=0.0) == []
    policy.drain()
    assert len(policy.decide(now=0.0)) == 1


def test_without_merge_a_cycle_holds_nothing():
    policy = SchedulingPolicy(partition_bytes=100, credit_bytes=1000, merge=False, cycle_seconds=10.0)
    policy.add(task(0, 5), now=0.0)
    assert policy.hold_remaining(now=0.0) == 0.0 and len(policy.decide(now=0.0)) == 1


# ---------------------------------------------------------------------------- determinism


def _replay(seed: int) -> List[tuple]:
    """Drive a policy with random arrivals and completions on a fake clock; return its decisions."""
    rng = random.Random(seed)
    policy = SchedulingPolicy(partition_bytes=64, credit_bytes=256, fast_lane_bytes=16, lanes=2,
                              cycle_seconds=0.001)
    now, in_flight, decisions = 0.0, [], []
    for step in range(2000):
        now += rng.random() * 0.0005
        if rng.random() < 0.4:
            policy.add(task(step, rng.randint(1, 300), priority=rng.randint(0, 20)), now)
        if in_flight and rng.random() < 0.5:
            policy.finished(in_flight.pop(rng.randrange(len(in_flight))))
        if rng.random() < 0.05:
            policy.end_burst()
        ops = policy.decide(now)
        assert policy.main.in_flight <= max(256, max((op.nbytes for op in ops), default=0)) or len(ops) <= 1
        in_flight.extend(ops)
        decisions.extend(shape(ops))
    return decisions


def test_the_same_events_give_the_same_decisions():
    first = _replay(7)
    assert len(first) > 500
    assert _replay(7) == first
    assert _replay(8) != first


def test_every_element_is_decided_exactly_once_and_the_credit_holds():
    rng = random.Random(3)
    policy = SchedulingPolicy(partition_bytes=50, credit_bytes=200, fast_lane_bytes=20, lanes=2)
    sizes = {key: rng.randint(1, 400) for key in range(200)}
    for key, numel in sizes.items():
        policy.add(task(key, numel, priority=rng.randint(0, 9)), now=0.0)
    seen = {key: [] for key in sizes}
    in_flight: List[Operation] = []
    while policy.queued or in_flight:
        ops = policy.decide(now=0.0)
        if policy.main.in_flight > 200:
            assert len([op for op in in_flight + ops if op.lane == 0]) == 1  # only one oversized piece alone
        assert policy.fast is None or policy.fast.in_flight <= max(20, max((op.nbytes for op in ops), default=0))
        for op in ops:
            for piece in op.pieces:
                seen[piece.task.key].append((piece.start, piece.stop))
        in_flight.extend(ops)
        if in_flight:
            policy.finished(in_flight.pop(0))
    for key, ranges in seen.items():
        assert sorted(ranges)[0][0] == 0 and sum(b - a for a, b in ranges) == sizes[key]
    assert policy.main.in_flight == 0 and policy.queued_bytes == 0


# ---------------------------------------------------------------------------- follower and ledger


def test_follower_replays_decisions_in_order_as_its_own_tensors_become_ready():
    ledger = Ledger(rank=1)
    follower = Follower(rank=1, lanes=2, ledger=ledger)
    a, b = task(0, 10), task(1, 10)
    follower.receive([(0, [(1, 0, 0, 10)]), (1, [(0, 0, 0, 10)])], now=0.0)
    ledger.add(a)
    follower.add(a, now=0.0)
    assert follower.decide(now=0.0) == []  # the first decision names key 1, not ready here yet
    ledger.add(b)
    follower.add(b, now=0.0)
    assert shape(follower.decide(now=0.0)) == [(0, [(1, 0, 10)]), (1, [(0, 0, 10)])]
    assert follower.undecided_elements == 0


def test_follower_refuses_ranges_beyond_its_tensor_and_stale_generations():
    ledger = Ledger(rank=1)
    follower = Follower(rank=1, lanes=1, ledger=ledger)
    small = task(0, 5)
    ledger.add(small)
    follower.receive([(0, [(0, 0, 0, 10)])], now=0.0)
    with pytest.raises(MismatchError, match="same shape"):
        follower.decide(now=0.0)
    ledger.generations[3] = 2
    follower.clear()
    follower.receive([(0, [(3, 0, 0, 1)])], now=0.0)
    with pytest.raises(MismatchError, match="again after it completed"):
        follower.decide(now=0.0)


def test_follower_overdue_decision_and_stop_with_tensors_left_are_mismatches():
    ledger = Ledger(rank=1)
    follower = Follower(rank=1, lanes=1, ledger=ledger)
    follower.receive([(0, [(4, 0, 0, 1)])], now=0.0)
    follower.check_overdue(now=0.5, limit=1.0)
    with pytest.raises(MismatchError, match=r"\(4, 0\)"):
        follower.check_overdue(now=1.5, limit=1.0)
    follower.clear()
    ledger.add(task(5, 1))
    follower.stop_received = True
    with pytest.raises(MismatchError, match="rank 0 stopped"):
        follower.drained()


def test_ledger_counts_generations_and_completes_tasks_when_every_piece_is_back():
    ledger = Ledger(rank=0)
    policy = SchedulingPolicy(partition_bytes=4, credit_bytes=100, merge=False)
    first, second = task(7, 10), task(7, 10)
    ledger.add(first)
    ledger.add(second)
    assert (first.generation, second.generation) == (0, 1)
    policy.add(first, now=0.0)
    ops = policy.decide(now=0.0)
    for op in ops:
        ledger.launched([op], now=0.0)
    assert list(ledger.complete(ops[0])) == [] and ledger.complete(ops[0]) is None  # a late duplicate
    assert list(ledger.complete(ops[1])) == [] and list(ledger.complete(ops[2])) == [first]
    assert list(ledger.pending) == [(7, 1)]


def test_frames_carry_any_message():
    message = list(range(-5, 3000))
    frames = to_frames(message, words=128)
    assert all(len(frame) == 128 for frame in frames)
    received: List[int] = []
    more = [read_frame(list(frame), received) for frame in frames]
    assert received == message and more == [True] * (len(frames) - 1) + [False]
    with pytest.raises(MismatchError, match="corrupt"):
        read_frame([500, 0, 1, 2], [])


@pytest.mark.parametrize("module", ["policy", "follower", "ledger", "ordering", "errors", "config", "values", "plan", "partition",
                                    "credit", "scheduler", "tcp_channel", "timeline", "call_thread", "modes", "grain",
                                    "agreement"])
def test_core_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"bytescheduler.core.{module}"), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
