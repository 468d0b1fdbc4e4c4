"""Being told by MXNet's engine when arrays are computed, instead of blocking until they are.

MXNet's Python API can only block (``wait_to_read``), so a thread that must hand over many
arrays as each is computed has to guess which one to block on first, and an array computed
while it blocks on another waits. The engine itself knows: :func:`when_readable` queues a
no-op operation that *reads* the arrays (``MXEnginePushSyncND``, in MXNet since 1.6), and the
engine runs it once every write queued on them before has finished, in the order the
computations finish. It runs on the engine's prioritized CPU workers
(``MXNET_CPU_PRIORITY_NTHREADS``, 4 by default), not behind the queued computations.

When a computation failed, MXNet skips the operations that read its result; the operation's
parameter is released even then, so the callback is called from the release instead. Either
way the callback is called exactly once, on an engine thread (or, with ``NaiveEngine``, on
the caller's, before :func:`when_readable` returns): it must be quick and must not call into
MXNet. Whoever then reads the arrays learns of a failure from ``wait_to_read``, which returns
at once for computed arrays.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any, Callable, Dict, List

import mxnet as mx

_SyncFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Context(ctypes.Structure):
    """``mxnet::Context``: device type (1 = CPU) and device id."""

    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


# The operation runs on the CPU whatever the arrays' device, as MXNet's own wait_to_read does
# (untested with arrays on a GPU: this project has none).
_CPU = _Context(1, 0)
# mxnet::FnProperty::kCPUPrioritized: the engine's prioritized CPU worker pool.
_CPU_PRIORITIZED = ctypes.c_int(3)
_NAME = b"bytescheduler:readable"

_callbacks: Dict[int, Callable[[], None]] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def _call(ident: int) -> None:
    with _lock:
        callback = _callbacks.pop(ident, None)
    if callback is not None:
        callback()


# Module-level so that they outlive every operation still queued in the engine.
_RUN = _SyncFn(lambda _ctx, param: _call(param))
_RELEASE = _Deleter(_call)


def when_readable(arrays: List[Any], callback: Callable[[], None]) -> None:
    """Call ``callback()`` once every write queued on ``arrays`` before this call finished or
    failed. Where the engine cannot be asked (an old MXNet, a refused call), at once."""
    ident = next(_ids)
    with _lock:
        _callbacks[ident] = callback
    try:
        handles = (mx.base.NDArrayHandle * len(arrays))(*(arr.handle for arr in arrays))
        mx.base.check_call(mx.base._LIB.MXEnginePushSyncND(
            _RUN, ctypes.c_void_p(ident), _RELEASE, ctypes.byref(_CPU), handles, len(arrays),
            None, 0, ctypes.byref(_CPU_PRIORITIZED), 0, ctypes.c_char_p(_NAME)))
    except (AttributeError, mx.base.MXNetError):
        _call(ident)  # the caller then blocks on the arrays itself
