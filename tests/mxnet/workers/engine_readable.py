"""bytescheduler.mxnet.engine.when_readable against MXNet's real engine (no servers needed).

    engine_readable.py

Prints one line per case, ``CASE name key=value ...``:
- ``order``: a slow array (a chain of products still being computed) is registered before a
  ready one; the order the callbacks came in, which had come 50 ms in, when the slow one's
  came, and how long ``wait_to_read`` on the slow array took right after its callback (near
  zero when the callback really came after the computation).
- ``failed``: an array whose computation fails in the engine (a normal distribution with a
  negative scale); whether the callback came at all, and what ``wait_to_read`` raised after.
- ``several``: one callback for two arrays, one of them slow: how many times it came, when,
  and how long ``wait_to_read`` on the slow one took right after it.
"""

import threading
import time

import mxnet as mx

from bytescheduler.mxnet.engine import when_readable
from kv_ready import SIDE, products_for  # this folder: the chain's length from timed samples
TIMEOUT = 30.0


def chain(seconds: float):
    """A product chain queued on the engine that takes about ``seconds`` to compute."""
    factor = mx.nd.ones((SIDE, SIDE)) / SIDE
    slow = factor
    for _ in range(products_for(seconds, factor)):
        slow = mx.nd.dot(slow, factor)
    return slow


def recorder():
    calls, done = [], threading.Event()

    def record(name, expected):
        def callback():
            calls.append((name, time.perf_counter()))
            if len(calls) == expected:
                done.set()
        return callback
    return calls, done, record


def case_order() -> None:
    calls, done, record = recorder()
    ready = mx.nd.ones((100,))
    mx.nd.waitall()
    slow = chain(0.4)
    when_readable([slow], record("slow", 2))
    when_readable([ready], record("ready", 2))
    time.sleep(0.05)
    before = [name for name, _ in calls]
    began = time.perf_counter()
    assert done.wait(TIMEOUT), calls
    slow_at = dict(calls)["slow"]
    began_after = time.perf_counter()
    slow.wait_to_read()
    after_wait = time.perf_counter() - began_after
    print(f"CASE order calls={','.join(name for name, _ in calls)} before={','.join(before) or '-'} "
          f"slow_after={slow_at - began:.3f} wait_after={after_wait:.4f}", flush=True)


def case_failed() -> None:
    calls, done, record = recorder()
    bad = mx.nd.random.normal(0, -1, shape=(2, 2))
    product = mx.nd.dot(bad, bad)
    when_readable([product], record("failed", 1))
    came = done.wait(TIMEOUT)
    try:
        product.wait_to_read()
        raised = "nothing"
    except mx.base.MXNetError as exc:
        raised = type(exc).__name__
    print(f"CASE failed came={came} raised={raised}", flush=True)


def case_several() -> None:
    calls, done, record = recorder()
    ready = mx.nd.ones((100,))
    mx.nd.waitall()
    slow = chain(0.3)
    began = time.perf_counter()
    when_readable([ready, slow], record("both", 1))
    assert done.wait(TIMEOUT), calls
    came = calls[0][1] - began
    began_after = time.perf_counter()
    slow.wait_to_read()
    after_wait = time.perf_counter() - began_after
    time.sleep(0.2)  # a second callback would show here
    print(f"CASE several count={len(calls)} came={came:.3f} wait_after={after_wait:.4f}", flush=True)


if __name__ == "__main__":
    case_order()
    case_failed()
    case_several()
