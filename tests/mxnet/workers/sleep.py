"""A dist_sync worker that joins the job, prints ``READY rank=R`` and then sleeps for
``SLEEP_SECONDS`` (default 600): a job that only ends when the launcher stops it."""

import os
import time

import mxnet as mx


def main() -> None:
    kv = mx.kv.create("dist_sync")
    assert kv.type == "dist_sync", kv.type
    kv.init(7, mx.nd.zeros((4,)))
    print(f"READY rank={kv.rank}", flush=True)
    time.sleep(float(os.environ.get("SLEEP_SECONDS", "600")))


if __name__ == "__main__":
    main()
