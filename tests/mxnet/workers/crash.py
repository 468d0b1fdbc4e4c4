"""A dist_sync job in which the worker started second (launch index 1) dies with exit code 3.

Both workers create the store and initialise a key together; then worker 1 exits at once
(``os._exit``: no clean-up, like a crash) while worker 0 pushes and pulls, which blocks forever
in ps-lite because worker 1's push never arrives.
"""

import os
import sys

import mxnet as mx


def main() -> int:
    kv = mx.kv.create("dist_sync")
    assert kv.type == "dist_sync", kv.type
    kv.init(7, mx.nd.zeros((4,)))
    index = os.environ["BYTESCHEDULER_LAUNCH_INDEX"]
    if index == "1":
        print(f"CRASHING rank={kv.rank}", flush=True)
        os._exit(3)
    print(f"WAITING rank={kv.rank}", flush=True)
    kv.push(7, mx.nd.ones((4,)))
    out = mx.nd.zeros((4,))
    kv.pull(7, out=out)
    out.wait_to_read()
    print(f"UNEXPECTED pull returned {out.asnumpy()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
