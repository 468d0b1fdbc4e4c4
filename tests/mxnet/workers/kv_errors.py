"""dist_sync worker: bad inputs to ScheduledKVStore give clear errors; the store stays usable."""

import mxnet as mx

from bytescheduler.launcher import run_worker


def expect(exc_type, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert words in str(exc), (words, str(exc))
        print(f"ERROR OK {exc_type.__name__}: {exc}")
        return
    raise AssertionError(f"no {exc_type.__name__} from {fn.__name__}{args}")


def main() -> None:
    from bytescheduler.mxnet.kvstore import ScheduledKVStore
    expect(ValueError, "unknown kvstore type 'bogus'", ScheduledKVStore, "bogus")
    expect(TypeError, "store must be", ScheduledKVStore, 3)
    expect(ValueError, "larger than partition_bytes", ScheduledKVStore, "dist_sync", partition_bytes=64,
           grain_bytes=128)
    kv = ScheduledKVStore("dist_sync", partition_bytes=64, timeout=30)
    expect(TypeError, "already a ScheduledKVStore", ScheduledKVStore, kv)
    expect(KeyError, "was not initialised", kv.pull, 5, out=mx.nd.zeros((4,)))
    expect(KeyError, "was not initialised", kv.push, 5, mx.nd.zeros((4,)))
    expect(KeyError, "was not initialised", kv.pushpull, 5, mx.nd.zeros((4,)))
    # A bad entry in a key list: nothing of the call is done (no key half initialised).
    expect(TypeError, "cannot mix int and str keys", kv.init, [6, "x"], [mx.nd.zeros((4,))] * 2)
    expect(ValueError, "has shape (3,) but", kv.broadcast, [6, 7], [mx.nd.zeros((4,))] * 2,
           [mx.nd.zeros((4,)), mx.nd.zeros((3,))])
    expect(KeyError, "was not initialised", kv.pull, 6, out=mx.nd.zeros((4,)))
    kv.init(5, mx.nd.zeros((40,)))
    expect(ValueError, "already initialised", kv.init, 5, mx.nd.zeros((40,)))
    expect(TypeError, "cannot mix int and str keys", kv.init, "w", mx.nd.zeros((4,)))
    expect(ValueError, "has shape (4,) but the key was initialised with shape (40,)",
           kv.pushpull, 5, mx.nd.zeros((4,)))
    expect(ValueError, "has shape (3,) but", kv.pull, 5, out=mx.nd.zeros((3,)))
    expect(ValueError, "dtype", kv.push, 5, mx.nd.zeros((40,), dtype="float64"))
    expect(ValueError, "out of range", kv.init, 10**6, mx.nd.zeros((4,)))
    expect(TypeError, "cannot mix int and str keys", kv.pull, "w", out=mx.nd.zeros((4,)))
    expect(ValueError, "has shape (4,) but", kv.push, [5], [mx.nd.zeros((4,))])
    expect(ValueError, "has shape (40, 1) but", kv.pushpull, 5, mx.nd.zeros((40,)), out=mx.nd.zeros((40, 1)))
    expect(ValueError, "per-tensor norms", kv.set_optimizer, mx.optimizer.LAMB())
    expect(ValueError, "below the server grain of 64 bytes", kv.set_partition_bytes, 32)
    expect(ValueError, "is not a size", kv.set_partition_bytes, "lots")
    # still usable after the errors
    value = mx.nd.ones((40,)) * (kv.rank + 1)
    kv.pushpull(5, value)
    assert (value.asnumpy() == 3).all(), value
    kv.close()
    print(f"DONE rank={kv.rank}")


if __name__ == "__main__":
    run_worker(main)
