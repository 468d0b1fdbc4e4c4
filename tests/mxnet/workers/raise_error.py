"""A dist_sync job in which the worker started second raises an exception after ``kv.init``.

Run through ``run_worker``, the failing worker exits at once with status 1 (the traceback is
printed); without it, it would wait forever in ps-lite's finalize barrier.
"""

import os

import mxnet as mx

from bytescheduler.launcher import run_worker


def main() -> None:
    kv = mx.kv.create("dist_sync")
    assert kv.type == "dist_sync", kv.type
    kv.init(7, mx.nd.zeros((4,)))
    if os.environ["BYTESCHEDULER_LAUNCH_INDEX"] == "1":
        raise RuntimeError(f"worker failure on purpose (rank {kv.rank})")
    print(f"WAITING rank={kv.rank}", flush=True)
    kv.push(7, mx.nd.ones((4,)))
    out = mx.nd.zeros((4,))
    kv.pull(7, out=out)
    out.wait_to_read()
    print(f"UNEXPECTED pull returned {out.asnumpy()}", flush=True)


if __name__ == "__main__":
    run_worker(main)
