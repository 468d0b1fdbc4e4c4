"""dist_sync worker: push/pull/pushpull of rank-dependent random values; saves what it pulled.

    kv_sums.py MODE OUTDIR        MODE: plain (unwrapped mx store) | wrapped (ScheduledKVStore)

Rounds (priority -key everywhere):
  0  push then pull, key by key
  1  pushpull into separate outputs
  2  push of a key list with two values per key (the store adds them first), pull of a key list
     into two outputs per key
  3  push then pull again
then a pushpull in place (out=None), as gluon's Trainer does without update_on_kvstore.

Wrapped: grain 4096 B, so key 2 (30,000 float32) lives on the servers as 30 sub-keys; the
partition size changes every round (ROUND_PARTITIONS). Every piece goes through the scheduler:
the worker checks the scheduler's piece count and that rank 0's credit held. Saves
OUTDIR/MODE-rank{R}.npz and checks every sum exactly.
"""

import os
import sys

import mxnet as mx
import numpy as np

from bytescheduler.launcher import run_worker

SHAPES = {0: (7,), 1: (3, 50), 2: (300, 100)}
GRAIN, CREDIT = 4096, 16384
ROUND_PARTITIONS = [8192, 8192, 16384, 4096]  # the last one also for the in-place pushpull
OPS_PER_ROUND = [2, 1, 2, 2]  # push + pull, pushpull, push + pull, push + pull


def draw(step, key, rank, copy=0):
    seed = 1000 * step + 10 * key + rank + 100_000 * copy
    return np.random.RandomState(seed).uniform(-1, 1, SHAPES[key]).astype(np.float32)


def expected_pieces():
    """Pieces the scheduler must launch: a key of n sub-keys goes in ceil(n / sub-keys per piece)."""
    grains = {key: -(-int(np.prod(shape)) * 4 // GRAIN) for key, shape in SHAPES.items()}
    total = 0
    for partition, ops in zip(ROUND_PARTITIONS + ROUND_PARTITIONS[-1:], OPS_PER_ROUND + [1]):
        per_piece = partition // GRAIN
        total += ops * sum(-(-n // per_piece) for n in grains.values())
    return total


def main(mode: str, outdir: str) -> None:
    wrapped = mode == "wrapped"
    if wrapped:
        from bytescheduler.mxnet.kvstore import ScheduledKVStore
        kv = ScheduledKVStore("dist_sync", partition_bytes=ROUND_PARTITIONS[0], grain_bytes=GRAIN,
                              credit_bytes=CREDIT, timeout=60)
        assert kv.scheduler is not None and kv.type == "dist_sync"
    else:
        kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    for key, shape in SHAPES.items():
        kv.init(key, mx.nd.zeros(shape))
    if wrapped:
        assert len(kv._layout.info(2).subkeys) == 30, kv._layout.info(2).subkeys
    results = {}
    grads = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    extra = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    outs = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    outs2 = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    keys = list(SHAPES)
    for step, partition in enumerate(ROUND_PARTITIONS):
        if wrapped:
            assert kv.set_partition_bytes(partition) == partition == kv.partition_bytes
        want = {}
        for key in keys:
            grads[key][:] = draw(step, key, rank)
            want[key] = sum(draw(step, key, r) for r in range(workers))
        if step == 1:
            for key in keys:
                kv.pushpull(key, grads[key], out=outs[key], priority=-key)
        elif step == 2:
            for key in keys:
                extra[key][:] = draw(step, key, rank, copy=1)
                want[key] = sum(draw(step, key, r) + draw(step, key, r, copy=1) for r in range(workers))
            kv.push(keys, [[grads[k], extra[k]] for k in keys], priority=-1)
            kv.pull(keys, out=[[outs[k], outs2[k]] for k in keys], priority=-1)
        else:
            for key in keys:
                kv.push(key, grads[key], priority=-key)
                kv.pull(key, out=outs[key], priority=-key)
        for key in keys:
            got = outs[key].asnumpy()
            assert np.array_equal(got, want[key]), (step, key, np.abs(got - want[key]).max())
            results[f"s{step}k{key}"] = got
            if step == 2:
                assert np.array_equal(outs2[key].asnumpy(), got), (step, key)
    for key in keys:
        grads[key][:] = rank + 1
        kv.pushpull(key, grads[key])
    for key in keys:
        got = grads[key].asnumpy()
        assert (got == workers * (workers + 1) / 2).all(), (key, got)
        results[f"inplace{key}"] = got
    if wrapped:
        kv.synchronize()
        stats = kv.scheduler.stats
        assert stats["pieces"] == expected_pieces(), (stats, expected_pieces())
        if rank == 0:  # rank 0 decides under the credit; the others replay its decisions
            assert stats["peak_in_flight_bytes"] <= CREDIT, stats
        print(f"STATS rank={rank} {stats}")
        kv.close()
        kv.close()  # idempotent
    np.savez(os.path.join(outdir, f"{mode}-rank{rank}.npz"), **results)
    print(f"DONE rank={rank} mode={mode}")


if __name__ == "__main__":
    run_worker(main, sys.argv[1], sys.argv[2])
