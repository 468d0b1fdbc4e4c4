"""dist_sync worker: push/pull/pushpull of rank-dependent random values; saves what it pulled.

    kv_sums.py MODE OUTDIR        MODE: plain (unwrapped mx store) | wrapped (ScheduledKVStore)

Keys 0-2 use push+pull, keys 0-2 again pushpull. With partition_bytes=4096, key 2 (30,000
float32) is split into 30 sub-keys. Saves OUTDIR/MODE-rank{R}.npz and checks the exact sum.
"""

import os
import sys

import mxnet as mx
import numpy as np

from bytescheduler.mxnet.launch import run_worker

SHAPES = {0: (7,), 1: (3, 50), 2: (300, 100)}
ROUNDS = 3


def main(mode: str, outdir: str) -> None:
    if mode == "wrapped":
        from bytescheduler.mxnet.kvstore import ScheduledKVStore
        kv = ScheduledKVStore("dist_sync", partition_bytes=4096, timeout=60)
        assert kv.scheduler is not None and kv.type == "dist_sync"
    else:
        kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    for key, shape in SHAPES.items():
        kv.init(key, mx.nd.zeros(shape))
    if mode == "wrapped":
        assert len(kv._keys[2].ranges) > 1, kv._keys[2].ranges
    results = {}
    grads = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    outs = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
    for step in range(ROUNDS):
        vals = {}
        for key, shape in SHAPES.items():
            draws = [np.random.RandomState(1000 * step + 10 * key + r).uniform(-1, 1, shape).astype(np.float32)
                     for r in range(workers)]
            vals[key] = draws
            grads[key][:] = draws[rank]
            if step % 2 == 0:
                kv.push(key, grads[key])
                kv.pull(key, out=outs[key])
            else:
                kv.pushpull(key, grads[key], out=outs[key], priority=-key)
        for key in SHAPES:
            got = outs[key].asnumpy()
            want = vals[key][0] + vals[key][1]
            assert np.array_equal(got, want), (step, key, np.abs(got - want).max())
            results[f"s{step}k{key}"] = got
    # pushpull in place (out=None), as gluon's Trainer does without update_on_kvstore
    for key in SHAPES:
        grads[key][:] = rank + 1
        kv.pushpull(key, grads[key])
    for key in SHAPES:
        got = grads[key].asnumpy()
        assert (got == workers * (workers + 1) / 2).all(), (key, got)
        results[f"inplace{key}"] = got
    if mode == "wrapped":
        kv.close()
        kv.close()  # idempotent
    np.savez(os.path.join(outdir, f"{mode}-rank{rank}.npz"), **results)
    print(f"DONE rank={rank} mode={mode}")


if __name__ == "__main__":
    run_worker(main, sys.argv[1], sys.argv[2])
