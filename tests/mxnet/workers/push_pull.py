"""A dist_sync worker: init keys, push rank-dependent values, pull, check the sums.

Prints one ``CHECK OK`` line per key and round, and ``DONE rank=R`` at the end; exits 1
(with the reason) when a sum is wrong, at once through ``run_worker`` (a worker that exits
through the interpreter waits in ps-lite's finalize barrier for the others). Key 3 holds more
elements than MXNET_KVSTORE_BIGARRAY_BOUND (1,000,000 by default), so with several servers it
is split across all of them.
"""

import os
import sys

import mxnet as mx

from bytescheduler.launcher import run_worker

ROUNDS = 2
SHAPES = {1: (4,), 2: (3, 5), 3: (1_200_000,)}


def main() -> None:
    kv = mx.kv.create("dist_sync")
    # mx.kv.create silently falls back to a local store for an unknown type: check the real one.
    assert kv.type == "dist_sync", kv.type
    rank, workers = kv.rank, kv.num_workers
    assert workers == int(os.environ["DMLC_NUM_WORKER"]), (workers, os.environ["DMLC_NUM_WORKER"])
    print(f"START rank={rank} workers={workers} index={os.environ.get('BYTESCHEDULER_LAUNCH_INDEX')}")
    for key, shape in SHAPES.items():
        kv.init(key, mx.nd.zeros(shape))
    failures = 0
    for step in range(ROUNDS):
        for key, shape in SHAPES.items():
            # A new array every push: on CPU the store may alias the pushed array.
            kv.push(key, mx.nd.ones(shape) * (rank + 1) * (step + 1))
        for key, shape in SHAPES.items():
            out = mx.nd.zeros(shape)
            kv.pull(key, out=out)
            got = out.asnumpy()
            want = (step + 1) * workers * (workers + 1) / 2
            if got.min() == got.max() == want:
                print(f"CHECK OK rank={rank} round={step} key={key} sum={want:g}")
            else:
                failures += 1
                print(f"CHECK FAILED rank={rank} round={step} key={key} want={want:g} "
                      f"got min={got.min():g} max={got.max():g}")
    mx.nd.waitall()
    print(f"DONE rank={rank} failures={failures}")
    if failures:
        # Raised, not returned: see run_worker (a returned status comes after the store is freed).
        sys.exit(1)


if __name__ == "__main__":
    run_worker(main)
