"""dist_sync worker: an error raised on the store's kv thread reaches the caller as itself.

The inner store's ``pushpull`` raises ``OddError``, whose constructor takes a code and a detail
rather than a message, on both workers. The ScheduledKVStore's ``pushpull`` must raise an
``OddError`` chained to the original (copying it as ``type(error)(str(error))`` raised TypeError).
Prints ``RAISED rank=R <type>: <message> code=<code> cause=<type of __cause__>``.
"""

import sys

import mxnet as mx

from bytescheduler.launcher import run_worker


class OddError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code


def fail_pushpull(*args, **kwargs):
    raise OddError(28, "no space left on the server")


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    inner = mx.kv.create("dist_sync")
    kv = ScheduledKVStore(inner, partition_bytes=64, timeout=30)
    kv.init(0, mx.nd.zeros((40,)))
    inner.pushpull = fail_pushpull
    try:
        kv.pushpull(0, mx.nd.ones((40,)))
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        # One write: print() writes the line's end apart, and a log line from another thread
        # (to the same pipe, under the launcher) could land between.
        sys.stdout.write(f"RAISED rank={kv.rank} {type(exc).__name__}: {exc} code={getattr(exc, 'code', None)} "
                         f"cause={type(exc.__cause__).__name__}\n")
        sys.stdout.flush()
    else:
        raise AssertionError("pushpull did not raise although the inner store failed")
    # Both workers fail alike; neither leaves (closing rank 0's order channel) before the other has.
    inner._barrier()
    kv.close(wait=False)


if __name__ == "__main__":
    run_worker(main)
