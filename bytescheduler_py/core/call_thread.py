"""One thread that runs callables one at a time, each handed back as a ``Future``.

The adapters use it where a framework call must run off the caller's thread while the
caller waits with a deadline: the MXNet store's calls on its inner kvstore
(:mod:`bytescheduler.mxnet.backend`), Horovod's ``synchronize`` on Horovod's own path
(:mod:`bytescheduler.pytorch.horovod`). Each keeps its own deadline and messages.

>>> runner = CallThread("doc-example")
>>> runner.submit(lambda: 6 * 7).result(timeout=5)
42
>>> runner.close(timeout=5)
True
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

from .errors import ByteSchedulerError


class CallThread:
    """Runs submitted callables in order on one daemon thread, started by the first
    :meth:`submit` (or :meth:`start`). A callable submitted from that thread itself runs
    inline (re-entrant calls would otherwise wait on themselves). After :meth:`close`,
    :meth:`submit` raises :class:`~bytescheduler.core.errors.ByteSchedulerError` with
    ``closed_message``."""

    def __init__(self, name: str, closed_message: str = "the call thread was closed") -> None:
        self.name = name
        self._closed_message = closed_message
        self._queue: "queue.SimpleQueue[Optional[Tuple[Callable[[], Any], Future]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the thread; its result or exception comes back through the future."""
        future: Future = Future()
        if threading.current_thread() is self._thread:  # re-entrant: run inline
            _run_into(fn, future)
            return future
        if self._closed:
            raise ByteSchedulerError(self._closed_message)
        self.start()
        self._queue.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                _run_into(fn, future)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop taking calls, let the queued ones run, and wait up to ``timeout`` s (None: for
        good) for the thread to end. True when it ended (or never started)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _run_into(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:  # noqa: BLE001 - reported through the future
        future.set_exception(error)
