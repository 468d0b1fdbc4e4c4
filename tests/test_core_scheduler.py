"""Unit tests of the scheduling core: order, partition, merge, credit, preemption,
ordering across ranks, shutdown and error propagation. Everything runs in-process with
the fake backend of :mod:`tests.fakes`."""

from __future__ import annotations

import random
import threading
import time
from typing import List

import pytest

from bytescheduler.core import (
    CommunicationError,
    CommunicationTimeout,
    MismatchError,
    Scheduler,
    SchedulerClosed,
    Task,
)
from bytescheduler.core.ordering import LocalOrderHub
from bytescheduler.core.partition import partition_ranges
from tests.fakes import WAIT, FakeBackend, make_task, scheduler_threads


@pytest.fixture
def cleanup():
    """Register schedulers and backends; whatever a failing test left running is stopped."""
    schedulers: List[Scheduler] = []
    backends: List[FakeBackend] = []

    class Registry:
        def scheduler(self, backend, **options) -> Scheduler:
            if isinstance(backend, FakeBackend):
                backends.append(backend)
            scheduler = Scheduler(backend, **options)
            schedulers.append(scheduler)
            return scheduler

        def backend(self, *args, **kwargs) -> FakeBackend:
            backend = FakeBackend(*args, **kwargs)
            backends.append(backend)
            return backend

    yield Registry()
    for scheduler in schedulers:
        try:
            scheduler.stop(wait=False)
        except Exception:  # noqa: BLE001 - teardown only
            pass
    for backend in backends:
        try:
            backend.close()  # releases held operations; errors there have tests of their own
        except Exception:  # noqa: BLE001
            pass


def results(futures, timeout=WAIT):
    return [f.result(timeout=timeout) for f in futures]


# ---------------------------------------------------------------------------- 1. order


def test_held_op_then_priority_order(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100, merge=False)
    blocker = s.submit(make_task(100, 100, priority=0))
    backend.wait_launched(1)

    priorities = [5, 1, 3, 1, -2, 5, 2.5, 0, 3]
    futures = [s.submit(make_task(key, 100, priority=p)) for key, p in enumerate(priorities)]
    expected = [key for key, _ in sorted(enumerate(priorities), key=lambda kp: (kp[1], kp[0]))]

    # Credit admits one op at a time: nothing else may go while the first is held.
    assert backend.launched_keys() == [[100]]
    order = []
    for n in range(len(priorities)):
        backend.release()
        records = backend.wait_launched(n + 2)
        assert len(records) == n + 2, "more than one operation in flight despite the credit"
        order.append(records[-1].keys[0])
    backend.release()
    results(futures + [blocker])
    assert order == expected
    s.stop()
    assert backend.violations == []


def test_a_hold_keeps_the_next_iteration_back_until_released(cleanup):
    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, merge=False)
    s.hold(1)
    later = make_task(1, 10, priority=0)
    later.iteration = 2
    held = s.submit(later)
    time.sleep(0.2)  # the dispatcher had every chance to launch it
    assert not held.done() and backend.launched_keys() == []
    now = make_task(0, 10, priority=9)
    now.iteration = 1
    same = s.submit(now)  # what the hold waited for: its own iteration goes
    same.result(timeout=WAIT)
    assert backend.launched_keys() == [[0]]
    s.release(1)
    held.result(timeout=WAIT)
    assert backend.launched_keys() == [[0], [1]]
    s.stop()


def test_equal_priorities_are_first_come_first_served(cleanup):
    backend = cleanup.backend("manual", credit=50)
    s = cleanup.scheduler(backend, partition_bytes=20, credit_bytes=50, merge=True)
    blocker = s.submit(make_task(99, 1, itemsize=50, priority=7))
    backend.wait_launched(1)
    # Same priority and fuse_key None: arrival order, pieces of a task in element order.
    keys = [4, 2, 9, 0, 7]
    futures = [s.submit(make_task(k, 40, priority=7)) for k in keys]
    backend.release_until_done(futures + [blocker])
    results(futures + [blocker])
    s.stop()
    launched = [r.pieces for r in backend.ops[1:]]
    assert [p[0][0] for p in launched] == [k for k in keys for _ in range(2)]
    assert [(p[0][2], p[0][3]) for p in launched] == [(0, 20), (20, 40)] * len(keys)
    assert backend.violations == []


# ---------------------------------------------------------------------------- 2. partition


@pytest.mark.parametrize(
    "numel, itemsize, partition",
    [(10, 4, 16), (23, 2, 10), (23, 2, 7), (1, 1, 1), (7, 8, 5), (100, 1, 100), (101, 1, 100), (99, 3, 33), (5, 4, 4)],
)
def test_partition_ranges_contiguous_and_bounded(numel, itemsize, partition):
    ranges = partition_ranges(numel, itemsize, partition)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    for start, stop in ranges:
        assert stop - start >= 1
        assert (stop - start) * itemsize <= max(partition, itemsize)
    # As few pieces as the bound allows.
    per_piece = max(1, partition // itemsize)
    assert len(ranges) == -(-numel // per_piece)


def test_partition_ranges_random_property():
    rng = random.Random(1234)
    for _ in range(500):
        numel, itemsize, partition = rng.randint(1, 5000), rng.choice([1, 2, 3, 4, 8, 16]), rng.randint(1, 700)
        ranges = partition_ranges(numel, itemsize, partition)
        covered = [i for start, stop in ranges for i in (start, stop)]
        assert covered[0] == 0 and covered[-1] == numel
        assert all(covered[i] == covered[i + 1] for i in range(1, len(covered) - 1, 2))
        assert all(1 <= stop - start and ((stop - start) * itemsize <= partition or stop - start == 1)
                   for start, stop in ranges)


def test_partition_ranges_empty():
    assert partition_ranges(0, 4, 16) == []


@pytest.mark.parametrize("numel, itemsize, partition", [(23, 2, 10), (23, 2, 7), (1001, 4, 64), (9, 8, 5)])
def test_large_task_is_launched_as_contiguous_pieces(cleanup, numel, itemsize, partition):
    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend, partition_bytes=partition, credit_bytes=10_000, merge=False)
    task = make_task(3, numel, itemsize=itemsize)
    assert s.submit(task).result(timeout=WAIT) is task
    s.stop()
    pieces = [p for r in backend.ops for p in r.pieces]
    assert all(len(r.pieces) == 1 for r in backend.ops)
    assert [p[0] for p in pieces] == [3] * len(pieces)
    assert pieces[0][2] == 0 and pieces[-1][3] == numel
    for (_, _, _, stop), (_, _, start, _) in zip(pieces, pieces[1:]):
        assert stop == start, "pieces must be contiguous and launched in element order"
    for record in backend.ops:
        (_, _, start, stop), = record.pieces
        assert record.nbytes == (stop - start) * itemsize
        assert record.nbytes <= partition or stop - start == 1
    assert sum(r.nbytes for r in backend.ops) == numel * itemsize
    assert s.stats["pieces"] == len(pieces) == len(partition_ranges(numel, itemsize, partition))


def test_zero_size_task_resolves_immediately_without_launch(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, partition_bytes=8)
    task = make_task(5, 0, itemsize=4)
    future = s.submit(task)
    assert future.done(), "a zero-size task must resolve within submit"
    assert future.result(timeout=0) is task
    s.flush(timeout=WAIT)
    s.stop()
    assert backend.ops == []
    assert s.stats["operations"] == 0


# ---------------------------------------------------------------------------- 3. merge


def _blocked(cleanup, partition=100, credit=1000, merge=True, num_lanes=None):
    """A scheduler whose credit is fully used by one held operation (a one-element task)."""
    backend = cleanup.backend("manual", num_lanes=num_lanes, credit=credit)
    s = cleanup.scheduler(backend, partition_bytes=partition, credit_bytes=credit, merge=merge)
    blocker = s.submit(make_task(1000, 1, itemsize=credit, fuse_key="blocker"))
    backend.wait_launched(1)
    return backend, s, blocker


def _drain(backend, s, futures, launched):
    """Release the blocker, wait for ``launched`` more ops, release everything."""
    backend.release()
    backend.wait_launched(1 + launched)
    # Later operations may still come (if the test expected too few): release them too.
    backend.release_until_done(futures)
    results(futures)
    s.stop()
    assert backend.violations == []
    return [r for r in backend.ops[1:]]


def test_small_tasks_of_one_fuse_key_are_merged(cleanup):
    backend, s, blocker = _blocked(cleanup)
    futures = [s.submit(make_task(k, 30, fuse_key="f32")) for k in range(6)]
    ops = _drain(backend, s, futures + [blocker], 2)
    assert [r.keys for r in ops] == [[0, 1, 2], [3, 4, 5]]
    assert all(r.nbytes <= 100 and r.op.fused for r in ops)


def test_merge_fills_up_to_partition_bytes_exactly(cleanup):
    backend, s, blocker = _blocked(cleanup)
    sizes = [40, 60, 1, 99, 100, 50, 50, 51]
    futures = [s.submit(make_task(k, n, fuse_key="a")) for k, n in enumerate(sizes)]
    ops = _drain(backend, s, futures + [blocker], 5)
    assert [r.keys for r in ops] == [[0, 1], [2, 3], [4], [5, 6], [7]]
    assert [r.nbytes for r in ops] == [100, 100, 100, 100, 51]


def test_different_or_no_fuse_keys_are_never_merged(cleanup):
    backend, s, blocker = _blocked(cleanup)
    fuse_keys = ["a", "b", "a", "b", None, None, ("f32", "cpu"), ("f32", "cpu"), ("f16", "cpu")]
    futures = [s.submit(make_task(k, 10, fuse_key=fk)) for k, fk in enumerate(fuse_keys)]
    ops = _drain(backend, s, futures + [blocker], 7)
    assert [r.keys for r in ops] == [[0], [1], [2], [3], [4], [5], [6, 7], [8]]
    for record in ops:
        assert len({fuse_keys[k] for k in record.keys}) == 1
        assert None not in {fuse_keys[k] for k in record.keys} or len(record.keys) == 1


def test_merge_only_fuses_consecutive_heap_top_pieces(cleanup):
    backend, s, blocker = _blocked(cleanup)
    # Priorities put a task of another fuse key between the two "a" tasks.
    futures = [
        s.submit(make_task(0, 10, priority=0, fuse_key="a")),
        s.submit(make_task(1, 10, priority=2, fuse_key="a")),
        s.submit(make_task(2, 10, priority=1, fuse_key="b")),
        s.submit(make_task(3, 10, priority=3, fuse_key="b")),
    ]
    ops = _drain(backend, s, futures + [blocker], 4)
    assert [r.keys for r in ops] == [[0], [2], [1], [3]]


def test_merge_false_never_fuses(cleanup):
    backend, s, blocker = _blocked(cleanup, merge=False)
    futures = [s.submit(make_task(k, 10, fuse_key="same")) for k in range(5)]
    ops = _drain(backend, s, futures + [blocker], 5)
    assert [r.keys for r in ops] == [[k] for k in range(5)]
    assert s.stats["operations"] == s.stats["pieces"] == 6


def test_merge_stays_within_credit(cleanup):
    backend, s, blocker = _blocked(cleanup, partition=100, credit=60)
    futures = [s.submit(make_task(k, 30, fuse_key="a")) for k in range(4)]
    # 60 B of credit: two 30 B tasks per operation, one operation in flight at a time.
    backend.release()
    backend.wait_launched(2)
    assert backend.ops[1].keys == [0, 1]
    assert len(backend.ops) == 2
    backend.release()
    backend.wait_launched(3)
    assert backend.ops[2].keys == [2, 3]
    backend.release()
    results(futures + [blocker])
    s.stop()
    assert backend.violations == []


def test_tail_piece_of_partitioned_task_merges_with_next_task(cleanup):
    backend, s, blocker = _blocked(cleanup)
    futures = [s.submit(make_task(0, 230, fuse_key="a")), s.submit(make_task(1, 50, fuse_key="a"))]
    ops = _drain(backend, s, futures + [blocker], 3)
    assert [r.pieces for r in ops] == [[(0, 0, 0, 100)], [(0, 0, 100, 200)], [(0, 0, 200, 230), (1, 0, 0, 50)]]


# ---------------------------------------------------------------------------- lanes


def test_small_operations_use_the_fast_lane(cleanup):
    backend = cleanup.backend("immediate", num_lanes=2)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, merge=False, fast_lane_bytes=40)
    results([s.submit(make_task(k, n)) for k, n in enumerate([10, 40, 41, 100, 250])])
    s.stop()
    assert [(r.nbytes, r.lane) for r in backend.ops] == [
        (10, 1), (40, 1), (41, 0), (100, 0), (100, 0), (100, 0), (50, 0)]


def test_fast_lane_has_its_own_window_so_urgent_small_ops_pass_a_full_credit(cleanup):
    backend = cleanup.backend("manual", num_lanes=2)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=200, merge=False, fast_lane_bytes=40)
    big = s.submit(make_task(0, 400, priority=5))  # 4 pieces of 100; the credit holds 2
    backend.wait_launched(2)
    small = [s.submit(make_task(k, 20, priority=0)) for k in (1, 2, 3)]  # urgent and small
    backend.wait_launched(4)  # two of them go at once on lane 1 despite the full main credit
    lanes = [(r.nbytes, r.lane) for r in backend.ops]
    assert lanes == [(100, 0), (100, 0), (20, 1), (20, 1)], lanes
    assert len(backend.ops) == 4  # the third small op waits for room in the 40-byte fast window
    backend.release_until_done(small + [big])
    assert [r.lane for r in backend.ops].count(1) == 3
    results(small + [big])


def test_urgent_large_piece_takes_the_idle_fast_lane_instead_of_queueing_behind_main(cleanup):
    backend = cleanup.backend("manual", num_lanes=2)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=200, merge=False, fast_lane_bytes=40)
    late = s.submit(make_task(0, 400, priority=5))  # last layers: 4 pieces of 100, 2 in flight on lane 0
    backend.wait_launched(2)
    first_layer = s.submit(make_task(1, 100, priority=0))  # more urgent than all in flight, too big for 40
    backend.wait_launched(3)
    assert [(r.nbytes, r.lane) for r in backend.ops] == [(100, 0), (100, 0), (100, 1)]
    second = s.submit(make_task(2, 100, priority=1))  # urgent too, but the fast lane is busy now
    less_urgent = s.submit(make_task(3, 60, priority=9))  # never bypasses more urgent work in flight
    time.sleep(0.05)
    assert len(backend.ops) == 3, "nothing else may start until credit frees"
    backend.release_until_done([late, first_layer, second, less_urgent])
    lanes = {r.keys[0]: r.lane for r in backend.ops if r.keys[0] in (1, 3)}
    assert lanes == {1: 1, 3: 0}
    # In flight never exceeds the main credit plus one operation on the fast lane.
    assert max(r.in_flight_after for r in backend.ops) <= 200 + 100
    results([late, first_layer, second, less_urgent])


@pytest.mark.parametrize("num_lanes, fast_lane", [(None, 40), (1, 40), (2, 0)])
def test_single_lane_or_fast_lane_off(cleanup, num_lanes, fast_lane):
    backend = cleanup.backend("immediate", num_lanes=num_lanes)
    s = cleanup.scheduler(backend, partition_bytes=100, fast_lane_bytes=fast_lane)
    results([s.submit(make_task(k, n)) for k, n in enumerate([1, 10, 40, 100])])
    s.stop()
    assert [r.lane for r in backend.ops] == [0, 0, 0, 0]


# ---------------------------------------------------------------------------- 4. credit


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_credit_never_exceeded_under_random_completion(cleanup, seed):
    rng = random.Random(seed)
    credit, partition = 1000, 400
    backend = cleanup.backend("pool", credit=credit, delay=(0.0, 0.002), workers=6, seed=seed)
    s = cleanup.scheduler(backend, partition_bytes=partition, credit_bytes=credit, merge=True)
    tasks = []
    for key in range(150):
        itemsize = rng.choice([1, 2, 4, 4, 8])
        if rng.random() < 0.05:
            numel, itemsize = 1, rng.randint(credit + 1, 3 * credit)  # one element larger than the credit
        else:
            numel = rng.randint(0 if rng.random() < 0.05 else 1, 1500 // itemsize)
        tasks.append(make_task(key, numel, itemsize=itemsize, priority=rng.randint(0, 20),
                               fuse_key=rng.choice(["a", "b", None])))

    # Several submitting threads, like gradients becoming ready from autograd threads.
    futures = {}
    lock = threading.Lock()

    def submitter(chunk, pause):
        for task in chunk:
            future = s.submit(task)
            with lock:
                futures[task.key] = future
            time.sleep(pause)

    threads = [threading.Thread(target=submitter, args=(tasks[i::3], 0.0005 * i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(futures) == len(tasks)
    for task in tasks:
        assert futures[task.key].result(timeout=10) is task
    s.flush(timeout=WAIT)
    s.stop()

    assert backend.violations == []
    assert backend.callback_errors == []
    biggest = max(r.nbytes for r in backend.ops)
    assert backend.peak_in_flight_bytes <= max(credit, biggest)
    assert s.peak_in_flight_bytes <= max(credit, biggest)
    for record in backend.ops:
        if record.in_flight_after > credit:
            assert record.in_flight_before == 0 and record.nbytes > credit
        assert record.nbytes <= partition or len(record.pieces) == 1
    # Every byte of every task went out exactly once.
    covered = {}
    for record in backend.ops:
        for key, generation, start, stop in record.pieces:
            assert generation == 0
            covered.setdefault(key, []).append((start, stop))
    for task in tasks:
        ranges = sorted(covered.get(task.key, []))
        flat = [0] + [x for r in ranges for x in r] + [task.numel]
        assert all(flat[i] == flat[i + 1] for i in range(0, len(flat), 2)), (task, ranges)
    assert s.in_flight_bytes == 0 and backend.in_flight_bytes == 0


def test_oversized_piece_goes_alone_when_nothing_in_flight(cleanup):
    backend = cleanup.backend("manual", credit=100)
    s = cleanup.scheduler(backend, partition_bytes=1000, credit_bytes=100, merge=False)
    small = s.submit(make_task(0, 60))
    backend.wait_launched(1)
    big = s.submit(make_task(1, 500))
    tail = s.submit(make_task(2, 30, priority=5))
    # 60 + 30 fits the credit, but the 500 B task is first in the queue and must wait.
    assert backend.held[0][0].keys == [0]
    assert len(backend.ops) == 1
    backend.release()
    backend.wait_launched(2)
    assert backend.ops[1].keys == [1] and backend.ops[1].in_flight_before == 0
    assert len(backend.ops) == 2, "nothing may join an operation larger than the credit"
    backend.release()
    backend.wait_launched(3)
    backend.release()
    results([small, big, tail])
    s.stop()
    assert backend.violations == []
    assert s.peak_in_flight_bytes == 500


# ---------------------------------------------------------------------------- 5. preemption


def test_high_priority_task_preempts_remaining_pieces(cleanup):
    backend = cleanup.backend("manual", credit=100)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100, merge=True)
    large = s.submit(make_task(0, 1000, priority=10, fuse_key="a"))  # 10 pieces
    backend.wait_launched(1)
    backend.release()
    backend.wait_launched(2)
    assert backend.ops[1].pieces == [(0, 0, 100, 200)]

    urgent = s.submit(make_task(1, 250, priority=0, fuse_key="a"))  # 3 pieces
    backend.release()
    order = []
    for n in range(3 + 8):  # the urgent task's 3 pieces, then the large one's last 8
        backend.wait_launched(n + 3)
        order.append(backend.ops[n + 2].pieces)
        backend.release()
    assert urgent.result(timeout=WAIT).key == 1 and large.result(timeout=WAIT).key == 0
    s.stop()
    assert order[:3] == [[(1, 0, 0, 100)], [(1, 0, 100, 200)], [(1, 0, 200, 250)]]
    assert order[3:] == [[(0, 0, start, start + 100)] for start in range(200, 1000, 100)]
    assert backend.violations == []


def test_urgent_task_completes_before_large_one(cleanup):
    backend = cleanup.backend("manual", credit=100)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100, merge=False)
    large = s.submit(make_task(0, 2000, priority=10))
    backend.wait_launched(1)
    urgent = s.submit(make_task(1, 100, priority=1))
    backend.release()
    backend.wait_launched(2)
    assert backend.ops[1].keys == [1]
    backend.release()
    assert urgent.result(timeout=WAIT).key == 1
    assert not large.done()
    backend.release_until_done([large])
    large.result(timeout=WAIT)
    assert [r.keys for r in backend.ops] == [[0], [1]] + [[0]] * 19
    s.stop()


# ---------------------------------------------------------------------------- 6. ordering across ranks


def _run_ranks(world, target, timeout=30.0):
    errors = []

    def wrap(rank):
        try:
            target(rank)
        except BaseException as error:  # noqa: BLE001
            errors.append((rank, error))

    threads = [threading.Thread(target=wrap, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not [t.name for t in threads if t.is_alive()], "a rank did not finish"
    if errors:
        raise errors[0][1]


def test_every_rank_launches_the_leaders_order(cleanup):
    world, iterations = 3, 25
    rng = random.Random(42)
    specs = [
        dict(key=k, numel=rng.randint(1, 300), itemsize=rng.choice([1, 2, 4]),
             priority=rng.randint(0, 5), fuse_key=rng.choice(["a", "b", None]))
        for k in range(12)
    ]
    specs.append(dict(key=12, numel=0, itemsize=4, priority=0, fuse_key="a"))  # empty on every rank
    hub = LocalOrderHub(world, timeout=20)
    backends = [cleanup.backend("pool", num_lanes=2, delay=(0, 0.001), seed=r) for r in range(world)]
    schedulers = [
        cleanup.scheduler(backends[r], channel=hub.channel(r), rank=r, partition_bytes=256,
                          credit_bytes=600, fast_lane_bytes=64, timeout=20)
        for r in range(world)
    ]

    def rank_main(rank):
        local = random.Random(1000 + rank)
        s = schedulers[rank]
        for it in range(iterations):
            order = specs[:]
            local.shuffle(order)
            futures = []
            for spec in order:
                if local.random() < 0.3:
                    time.sleep(local.uniform(0, 0.002))
                futures.append(s.submit(Task(payload=None, **spec)))
            for future, spec in zip(futures, order):
                task = future.result(timeout=20)
                assert task.key == spec["key"]
                assert task.generation == (it if spec["numel"] else -1)
        s.stop()

    _run_ranks(world, rank_main)

    sequences = [[r.signature for r in b.ops] for b in backends]
    assert len(sequences[0]) > 0
    for rank in range(1, world):
        assert sequences[rank] == sequences[0], f"rank {rank} launched a different sequence"
    # Generations grow per key; every generation of every key is covered exactly.
    covered = {}
    for lane, pieces in sequences[0]:
        assert lane in (0, 1)
        for key, generation, start, stop in pieces:
            covered.setdefault((key, generation), []).append((start, stop))
    expected = {(s["key"], g) for s in specs if s["numel"] for g in range(iterations)}
    assert set(covered) == expected
    for (key, _), ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == specs[key]["numel"]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert {lane for lane, _ in sequences[0]} == {0, 1}
    assert any(len(pieces) > 1 for _, pieces in sequences[0]), "expected some fused operations"


def test_follower_waits_for_its_own_tasks(cleanup):
    hub = LocalOrderHub(2, timeout=10)
    leader_backend = cleanup.backend("immediate")
    follower_backend = cleanup.backend("immediate")
    leader = cleanup.scheduler(leader_backend, channel=hub.channel(0), rank=0, partition_bytes=100, timeout=10)
    follower = cleanup.scheduler(follower_backend, channel=hub.channel(1), rank=1, partition_bytes=100, timeout=10)
    leader_futures = [leader.submit(make_task(k, 150)) for k in range(3)]
    results(leader_futures)
    assert follower_backend.ops == []
    # The follower submits in another order; it must still follow the leader.
    follower_futures = [follower.submit(make_task(k, 150)) for k in (2, 0)]
    follower_backend.wait_launched(2)
    assert [r.pieces for r in follower_backend.ops] == [[(0, 0, 0, 100)], [(0, 0, 100, 150)]]
    assert not follower_futures[0].done()  # key 2 waits behind key 1
    follower_futures.append(follower.submit(make_task(1, 150)))
    results(follower_futures)
    assert [r.signature for r in follower_backend.ops] == [r.signature for r in leader_backend.ops]
    _run_ranks(2, lambda r: (leader, follower)[r].stop())


def test_every_launch_happens_on_the_dispatcher_thread(cleanup):
    """Not on the submitting thread (launching from there merged less and measured slower),
    nor on the backend's completion thread, nor on a follower's receiver."""
    hub = LocalOrderHub(2, timeout=10)
    backends = [cleanup.backend("immediate"), cleanup.backend("immediate")]
    leader, follower = (cleanup.scheduler(backends[r], channel=hub.channel(r), rank=r, timeout=10,
                                          partition_bytes=100, credit_bytes=100, merge=False) for r in (0, 1))
    futures = [s.submit(make_task(k, 100)) for k in range(3) for s in (leader, follower)]
    results(futures)
    for rank, backend in enumerate(backends):
        assert [r.keys for r in backend.ops] == [[0], [1], [2]]
        assert {r.thread for r in backend.ops} == {f"bytescheduler-dispatch-r{rank}"}
    _run_ranks(2, lambda r: (leader, follower)[r].stop())


def test_a_publish_slower_than_the_watch_interval_is_not_a_timeout(cleanup):
    """An operation counts as in flight from the moment it is taken; a slow publish before
    its launch must not look like an operation stuck since time 0."""

    class SlowLeaderChannel:
        is_leader = True

        def publish(self, message):
            time.sleep(0.8)  # longer than the dispatcher's watch interval (0.5 s)

    backend = cleanup.backend("immediate")
    scheduler = cleanup.scheduler(backend, channel=SlowLeaderChannel(), timeout=2.0)
    future = scheduler.submit(make_task(0, 10))
    assert future.result(timeout=WAIT).key == 0
    scheduler.check()  # no CommunicationTimeout recorded
    scheduler.stop()


@pytest.mark.parametrize("seed", range(3))
def test_many_submitting_threads_keep_one_order_on_every_rank(cleanup, seed):
    """Submitting threads race each other; every rank launches in rank 0's order."""
    world, threads_per_rank, tasks_per_thread = 2, 4, 30
    hub = LocalOrderHub(world, timeout=20)
    backends = [cleanup.backend("pool", num_lanes=2, delay=(0, 0.0005), seed=seed * 10 + r) for r in range(world)]
    schedulers = [cleanup.scheduler(backends[r], channel=hub.channel(r), rank=r, partition_bytes=64,
                                    credit_bytes=256, fast_lane_bytes=32, timeout=20) for r in range(world)]

    def rank_main(rank):
        def submitter(t):
            rng = random.Random(seed * 100 + rank * 10 + t)
            keys = list(range(t * tasks_per_thread, (t + 1) * tasks_per_thread))
            rng.shuffle(keys)
            futures = [schedulers[rank].submit(make_task(k, 1 + k % 150, priority=k % 7, fuse_key="f"))
                       for k in keys]
            results(futures, timeout=20)

        workers = [threading.Thread(target=submitter, args=(t,)) for t in range(threads_per_rank)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        schedulers[rank].stop()

    _run_ranks(world, rank_main)
    sequences = [[r.signature for r in b.ops] for b in backends]
    assert sequences[1] == sequences[0]
    launched = {piece[0] for _, pieces in sequences[0] for piece in pieces}
    assert launched == set(range(threads_per_rank * tasks_per_thread))


# ---------------------------------------------------------------------------- 7. shutdown


def test_stop_joins_threads_and_rejects_submit(cleanup):
    before = set(threading.enumerate())
    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend)
    mine = scheduler_threads(before)
    assert [t.name for t in mine] == ["bytescheduler-dispatch-r0"]
    s.submit(make_task(0, 10)).result(timeout=WAIT)
    s.stop()
    assert not any(t.is_alive() for t in mine)
    assert scheduler_threads(before) == []
    with pytest.raises(SchedulerClosed):
        s.submit(make_task(1, 10))
    s.stop()  # a second stop is a no-op


def test_collective_stop_joins_leader_and_follower_threads(cleanup):
    before = set(threading.enumerate())
    hub = LocalOrderHub(3, timeout=10)
    backends = [cleanup.backend("pool", seed=r) for r in range(3)]
    schedulers = [cleanup.scheduler(backends[r], channel=hub.channel(r), rank=r, timeout=10) for r in range(3)]
    names = sorted(t.name for t in scheduler_threads(before))
    assert names == sorted(["bytescheduler-dispatch-r0", "bytescheduler-dispatch-r1", "bytescheduler-receive-r1",
                            "bytescheduler-dispatch-r2", "bytescheduler-receive-r2"])
    futures = [[s.submit(make_task(k, 100)) for k in range(4)] for s in schedulers]
    _run_ranks(3, lambda r: schedulers[r].stop())
    for fs in futures:
        assert all(f.done() for f in fs)
        results(fs, timeout=0)
    assert scheduler_threads(before) == []
    for s in schedulers:
        with pytest.raises(SchedulerClosed):
            s.submit(make_task(9, 1))


def test_context_manager_drains_and_stops(cleanup):
    before = set(threading.enumerate())
    backend = cleanup.backend("pool", delay=(0.001, 0.003))
    with Scheduler(backend, partition_bytes=64, credit_bytes=128) as s:
        futures = [s.submit(make_task(k, 200)) for k in range(5)]
    assert all(f.done() for f in futures)
    results(futures, timeout=0)
    assert scheduler_threads(before) == []
    with pytest.raises(SchedulerClosed):
        s.submit(make_task(0, 1))


def test_context_manager_with_exception_abandons_promptly(cleanup):
    before = set(threading.enumerate())
    backend = cleanup.backend("manual")
    start = time.monotonic()
    with pytest.raises(KeyError):
        with Scheduler(backend, timeout=60) as s:
            s.submit(make_task(0, 10))
            backend.wait_launched(1)
            raise KeyError("training loop failed")
    assert time.monotonic() - start < 3.0, "an exception must not wait for held operations"
    assert scheduler_threads(before) == []
    with pytest.raises(SchedulerClosed):
        s.submit(make_task(1, 1))


def test_stop_with_wait_drains_pending_work_first(cleanup):
    before = set(threading.enumerate())
    backend = cleanup.backend("manual", credit=100)
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100, timeout=30)
    futures = [s.submit(make_task(k, 100, priority=k)) for k in range(5)]
    backend.wait_launched(1)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (s.stop(wait=True), stopped.set()))
    stopper.start()
    for n in range(1, 5):
        assert not stopped.wait(0.05), "stop(wait=True) returned with work still queued"
        backend.release()
        backend.wait_launched(n + 1)
    assert not stopped.is_set()
    backend.release()
    assert stopped.wait(WAIT), "stop did not return once the work drained"
    stopper.join(WAIT)
    assert [r.keys for r in backend.ops] == [[0], [1], [2], [3], [4]]
    assert all(f.done() for f in futures)
    results(futures, timeout=0)
    assert scheduler_threads(before) == []


def test_stop_without_wait_returns_with_ops_held(cleanup):
    before = set(threading.enumerate())
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, credit_bytes=10, partition_bytes=10, timeout=60)
    for k in range(3):
        s.submit(make_task(k, 10))
    backend.wait_launched(1)
    start = time.monotonic()
    s.stop(wait=False)
    assert time.monotonic() - start < 2.0
    assert scheduler_threads(before) == []
    backend.release_all()  # a late completion after stop must be harmless
    assert len(backend.ops) == 1


def test_stop_without_wait_fails_the_futures_of_abandoned_tasks(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, credit_bytes=10, partition_bytes=10, timeout=60)
    futures = [s.submit(make_task(k, 10)) for k in range(3)]
    backend.wait_launched(1)
    s.stop(wait=False)
    for future in futures:  # nobody waiting on one of these may hang
        with pytest.raises(SchedulerClosed, match="stopped before this task was communicated"):
            future.result(timeout=WAIT)


# ---------------------------------------------------------------------------- 8. errors


def _fail_key(key, error):
    return lambda op: error if any(p.task.key == key for p in op.pieces) else None


def test_failed_op_fails_future_and_later_calls(cleanup):
    backend = cleanup.backend("manual", fail=_fail_key(1, RuntimeError("nic exploded")))
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100, merge=False)
    ok = s.submit(make_task(0, 100))
    bad = s.submit(make_task(1, 100, priority=1))
    queued = s.submit(make_task(2, 100, priority=2))
    backend.release()  # key 0 succeeds
    assert ok.result(timeout=WAIT).key == 0
    backend.release()  # key 1 fails
    # The future raises the same kind of error as check(), caused by the backend's exception.
    with pytest.raises(CommunicationError, match="nic exploded") as info:
        bad.result(timeout=WAIT)
    assert isinstance(info.value.__cause__, RuntimeError) and "nic exploded" in str(info.value.__cause__)
    # A task still queued behind the failure must not hang.
    with pytest.raises(CommunicationError, match="nic exploded"):
        queued.result(timeout=WAIT)

    for call in (s.check, lambda: s.submit(make_task(3, 10)), lambda: s.flush(timeout=WAIT)):
        with pytest.raises(CommunicationError) as info:
            call()
        assert "nic exploded" in str(info.value) and "RuntimeError" in str(info.value)
    assert len(backend.ops) == 2, "nothing may be launched after a failure"
    s.stop(wait=False)


def test_launch_raising_fails_the_scheduler(cleanup):
    class Exploding:
        def launch(self, op, done):
            raise OSError("socket closed")

    s = cleanup.scheduler(Exploding())
    future = s.submit(make_task(0, 10))
    with pytest.raises(CommunicationError, match="socket closed"):
        future.result(timeout=WAIT)
    with pytest.raises(CommunicationError, match="socket closed"):
        s.check()
    s.stop(wait=False)


def test_stop_does_not_raise_an_error_already_raised(cleanup):
    """stop()'s docstring: raises the error "if the error was not raised before"."""
    backend = cleanup.backend("immediate", fail=lambda op: RuntimeError("boom"))
    s = cleanup.scheduler(backend)
    future = s.submit(make_task(0, 10))
    with pytest.raises(Exception):
        future.result(timeout=WAIT)
    with pytest.raises(CommunicationError):
        s.check()
    s.stop()  # the error was raised by check(): stop must not raise it again


def test_stop_raises_an_error_not_raised_before(cleanup):
    backend = cleanup.backend("immediate", fail=lambda op: RuntimeError("boom"))
    s = cleanup.scheduler(backend)
    future = s.submit(make_task(0, 10))
    with pytest.raises(Exception):
        future.result(timeout=WAIT)
    with pytest.raises(CommunicationError, match="boom"):
        s.stop()


def test_follower_without_leader_times_out(cleanup):
    hub = LocalOrderHub(2, timeout=30)  # the channel itself would wait long
    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend, channel=hub.channel(1), rank=1, timeout=1)
    future = s.submit(make_task(0, 10))
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout):
        s.flush(timeout=10)  # the scheduler's own timeout (1 s) must fire, not flush's
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed < 3.0, elapsed
    with pytest.raises(CommunicationTimeout):
        future.result(timeout=WAIT)
    with pytest.raises(CommunicationTimeout):
        s.check()
    assert backend.ops == []
    s.stop(wait=False)


def test_follower_channel_timeout(cleanup):
    hub = LocalOrderHub(2, timeout=1)
    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend, channel=hub.channel(1), rank=1, timeout=60)
    future = s.submit(make_task(0, 10))
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="rank 0"):
        future.result(timeout=WAIT)
    assert time.monotonic() - start < 3.0
    with pytest.raises(CommunicationTimeout):
        s.submit(make_task(1, 10))
    s.stop(wait=False)


def test_op_that_never_completes_times_out(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, timeout=1)
    future = s.submit(make_task(0, 10))
    backend.wait_launched(1)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout):
        s.flush(timeout=10)  # detected by the scheduler's watchdog
    assert time.monotonic() - start < 3.0
    with pytest.raises(CommunicationTimeout):
        future.result(timeout=WAIT)
    with pytest.raises(CommunicationTimeout):
        s.submit(make_task(1, 1))
    s.stop(wait=False)


def test_follower_with_a_different_tensor_size_raises_mismatch(cleanup):
    hub = LocalOrderHub(2, timeout=10)
    leader = cleanup.scheduler(cleanup.backend("immediate"), channel=hub.channel(0), rank=0,
                               partition_bytes=100, timeout=10)
    follower_backend = cleanup.backend("immediate")
    follower = cleanup.scheduler(follower_backend, channel=hub.channel(1), rank=1, partition_bytes=100, timeout=10)
    leader.submit(make_task(0, 100)).result(timeout=WAIT)
    with pytest.raises(MismatchError, match="same shape"):
        follower.submit(make_task(0, 50)).result(timeout=WAIT)
    with pytest.raises(MismatchError):
        follower.check()
    assert follower_backend.ops == []
    follower.stop(wait=False)
    leader.stop(wait=False)


def test_follower_with_a_task_the_leader_never_had_raises_mismatch_at_stop(cleanup):
    hub = LocalOrderHub(2, timeout=10)
    leader = cleanup.scheduler(cleanup.backend("immediate"), channel=hub.channel(0), rank=0, timeout=10)
    follower = cleanup.scheduler(cleanup.backend("immediate"), channel=hub.channel(1), rank=1, timeout=10)
    future = follower.submit(make_task(7, 10))
    leader.stop()  # rank 0 had nothing to communicate
    with pytest.raises(MismatchError, match="rank 0 stopped"):
        future.result(timeout=WAIT)
    with pytest.raises(MismatchError):
        follower.stop()


def test_late_completion_after_timeout_is_harmless(cleanup):
    """An operation the watchdog gave up on may still complete; done(None) must not raise."""
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, timeout=1)
    future = s.submit(make_task(0, 10))
    backend.wait_launched(1)
    with pytest.raises(CommunicationTimeout):
        future.result(timeout=WAIT)
    backend.release()  # the backend finally completes the operation
    assert backend.callback_errors == []
    with pytest.raises(CommunicationTimeout):
        s.check()
    s.stop(wait=False)


def test_completion_of_other_ops_after_a_failure_is_harmless(cleanup):
    backend = cleanup.backend("manual", fail=_fail_key(0, RuntimeError("link down")))
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, merge=False)
    failing = s.submit(make_task(0, 100))
    other = s.submit(make_task(1, 100))
    backend.wait_held(2)
    backend.release()  # key 0 fails while key 1 is still in flight
    with pytest.raises(Exception):
        failing.result(timeout=WAIT)
    backend.release()  # key 1 then completes normally
    assert backend.callback_errors == []
    assert other.done()
    with pytest.raises(CommunicationError, match="link down"):
        s.check()
    s.stop(wait=False)


def test_flush_default_timeout_is_the_configured_one(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, timeout=1)
    s.submit(make_task(0, 10))
    backend.wait_launched(1)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout):
        s.flush()
    assert 0.9 <= time.monotonic() - start < 3.0
    s.stop(wait=False)


def test_payload_is_released_when_the_task_is_done_without_the_garbage_collector(cleanup):
    # Task and future refer to each other; the payload (a gradient) must not wait for a
    # collection to be freed, or every backward allocates fresh memory.
    import gc
    import weakref

    class Payload:
        pass

    backend = cleanup.backend("immediate")
    s = cleanup.scheduler(backend, partition_bytes=8)
    gc.disable()
    try:
        payload = Payload()
        alive = weakref.ref(payload)
        task = Task(key=0, numel=20, itemsize=1, priority=0, payload=payload)
        seen = []
        task.future.add_done_callback(lambda done: seen.append(done.result().payload is not None))
        del payload
        s.submit(task).result(timeout=WAIT)
        assert seen == [True], "callbacks still see the payload"
        assert task.payload is None and alive() is None
    finally:
        gc.enable()


def test_an_operation_is_its_own_completion_callback(cleanup):
    # No object is made per operation just to carry its completion (a functools.partial
    # was one more for the garbage collector to traverse per operation in flight); the
    # backend's done is the operation, and calling it completes that operation only.
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, partition_bytes=8, credit_bytes=64)
    futures = [s.submit(Task(key=k, numel=16, itemsize=1, priority=k, payload=None)) for k in range(2)]
    backend.wait_launched(4)
    held = list(backend.held)
    assert all(done is record.op for record, done, _ in held)
    assert [record.pieces[0][0] for record, _, _ in held] == [0, 0, 1, 1]
    backend.release(2)  # calls done(None) of key 0's two pieces
    assert futures[0].result(timeout=WAIT).key == 0 and not futures[1].done()
    backend.release(2)
    assert futures[1].result(timeout=WAIT).key == 1


# --- cycle: holding queued work briefly so it merges ------------------------------------
def _launch_delay(backend, submitted_at, count=1):
    backend.wait_launched(count)
    return time.monotonic() - submitted_at


def test_cycle_holds_small_work_then_merges_it_into_one_operation(cleanup):
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=300)
    started = time.monotonic()
    futures = []
    for key in range(3):  # arrive a little apart, as a layer's gradients do in backward
        futures.append(s.submit(make_task(key, 10, fuse_key="a")))
        time.sleep(0.02)
    results(futures)
    assert time.monotonic() - started >= 0.25  # held for the cycle, not sent at once
    assert [r.keys for r in backend.ops] == [[0, 1, 2]]


def test_without_a_cycle_each_arrival_goes_alone(cleanup):
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=0)
    futures = []
    for key in range(3):
        futures.append(s.submit(make_task(key, 10, fuse_key="a")))
        backend.wait_launched(key + 1)
    results(futures)
    assert [r.keys for r in backend.ops] == [[0], [1], [2]]


def test_end_burst_launches_held_work_at_once_and_the_next_burst_is_held_again(cleanup):
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=400)
    started = time.monotonic()
    first = [s.submit(make_task(k, 10, fuse_key="a")) for k in range(2)]
    s.end_burst()
    results(first)
    assert time.monotonic() - started < 0.3
    assert [r.keys for r in backend.ops] == [[0, 1]]
    started = time.monotonic()
    second = s.submit(make_task(2, 10, fuse_key="a"))
    assert _launch_delay(backend, started, 2) >= 0.3  # a new cycle began with the empty queue
    results([second])


def test_without_merging_a_cycle_holds_nothing(cleanup):
    # e.g. BYTESCHEDULER_CYCLE_TIME set for a Horovod job, whose backend takes no merged work
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=60_000, merge=False)
    started = time.monotonic()
    futures = [s.submit(make_task(k, 10, fuse_key="a")) for k in range(2)]
    assert _launch_delay(backend, started, 2) < 5.0
    results(futures)
    assert [r.keys for r in backend.ops] == [[0], [1]]


def test_a_full_operation_is_not_held(cleanup):
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=60_000)
    started = time.monotonic()
    futures = [s.submit(make_task(k, 50, fuse_key="a")) for k in range(2)]
    results(futures)
    assert time.monotonic() - started < WAIT
    assert [r.keys for r in backend.ops] == [[0, 1]]


@pytest.mark.parametrize("finish", ["flush", "stop"])
def test_flush_and_stop_do_not_wait_for_the_cycle(cleanup, finish):
    backend = cleanup.backend()
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000, cycle_ms=60_000)
    started = time.monotonic()
    future = s.submit(make_task(0, 10))
    if finish == "flush":
        s.flush(timeout=WAIT)
    else:
        s.stop()
    assert future.done() and time.monotonic() - started < WAIT


# --- wake-ups: a completion wakes only who waits for it, and promptly ----------------------
# Both checks are well under the 0.5 s watch interval, which would hide a missing wake-up.
def test_flush_returns_promptly_when_the_last_operation_completes(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=1000)
    s.submit(make_task(0, 10))
    backend.wait_launched(1)
    returned = []
    flusher = threading.Thread(target=lambda: (s.flush(timeout=WAIT), returned.append(time.monotonic())))
    flusher.start()
    time.sleep(0.05)  # the flusher is asleep on the scheduler
    completed = time.monotonic()
    backend.release()
    flusher.join(WAIT)
    assert returned and returned[0] - completed < 0.2, returned


def test_a_completion_that_frees_credit_launches_queued_work_promptly(cleanup):
    backend = cleanup.backend("manual")
    s = cleanup.scheduler(backend, partition_bytes=100, credit_bytes=100)
    futures = [s.submit(make_task(key, 100)) for key in range(2)]
    backend.wait_launched(1)
    time.sleep(0.05)  # the dispatcher is asleep: the credit is full
    completed = time.monotonic()
    backend.release()
    backend.wait_launched(2)
    assert time.monotonic() - completed < 0.2
    backend.release()
    results(futures)
