"""One order on every rank over real gloo processes, with readiness skewed at random per rank."""

import random
import time

import pytest
import torch

from tests.distributed import run_ranks

ITERATIONS = 200
SIZES = [3, 70_000, 1_000, 250_000, 17, 40_000, 5_000, 120_000]


def _skewed_iterations(rank, world_size, fast_lane_bytes):
    from bytescheduler.core import Scheduler, Task
    from bytescheduler.pytorch import AllReduceBackend, ProcessGroups

    groups = ProcessGroups.claim(timeout=60)
    rng = random.Random(1000 + rank)
    checked = 0
    with Scheduler(
        AllReduceBackend(groups),
        channel=groups.order,
        rank=rank,
        partition_bytes=64 * 1024,
        credit_bytes=256 * 1024,
        fast_lane_bytes=fast_lane_bytes,
        timeout=60,
    ) as scheduler:
        for iteration in range(ITERATIONS):
            tensors = [
                torch.full((n,), float((rank + 1) * (key + 1) + iteration), dtype=torch.float32)
                for key, n in enumerate(SIZES)
            ]
            # Each rank makes its gradients ready in its own random order with random gaps.
            order = list(range(len(SIZES)))
            rng.shuffle(order)
            futures = {}
            for key in order:
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.002)
                futures[key] = scheduler.submit(
                    Task(key=key, numel=SIZES[key], itemsize=4, priority=key, payload=tensors[key],
                         fuse_key=torch.float32)
                )
            for key, future in futures.items():
                future.result(timeout=60)
                expected = sum((r + 1) * (key + 1) + iteration for r in range(world_size))
                assert torch.all(tensors[key] == expected), (
                    f"iteration {iteration} key {key}: got {tensors[key][:4]}, expected {expected}"
                )
                checked += 1
        stats = scheduler.stats
    groups.release()
    return checked, stats


@pytest.mark.parametrize("fast_lane_bytes", [0, 64 * 1024], ids=["one-lane", "fast-lane"])
def test_three_ranks_random_skew_same_order_correct_sums(fast_lane_bytes):
    results = run_ranks(_skewed_iterations, world_size=3, args=(fast_lane_bytes,), deadline=240)
    for checked, stats in results:
        assert checked == ITERATIONS * len(SIZES)
    # Every rank issued the same number of operations (the leader's decisions).
    assert len({stats["operations"] for _, stats in results}) == 1
    # Large tensors were partitioned: more pieces than tensors.
    assert results[0][1]["pieces"] > ITERATIONS * len(SIZES)
