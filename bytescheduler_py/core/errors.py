"""Exceptions raised by bytescheduler, and the latch that keeps the first one.

A failure found on one thread (a backend's completion, an updater) must reach the user's
training thread, maybe several times (every later call fails the same way). The
:class:`ErrorLatch` keeps the first error and raises it again where asked, as a new
exception of the same type chained to the original, so the original traceback survives.

>>> latch = ErrorLatch()
>>> latch.set(KeyError("gone")), latch.set(ValueError("later"))
(True, False)
>>> try:
...     latch.raise_if_set()
... except KeyError as error:
...     type(error.__cause__).__name__
'KeyError'
"""

from __future__ import annotations

import threading
from typing import NoReturn, Optional


class ByteSchedulerError(RuntimeError):
    """Base class of every error bytescheduler raises on purpose."""


class CommunicationError(ByteSchedulerError):
    """A communication operation failed (for example a peer process died).

    Once raised, the scheduler that raised it is unusable: stop it and, as
    with any collective failure, restart the job.
    """


class CommunicationTimeout(CommunicationError):
    """A communication operation, or a peer it waited for, took longer than the timeout."""


class SchedulerClosed(ByteSchedulerError):
    """The scheduler was used after ``stop()`` or before ``start()``."""


class MismatchError(CommunicationError):
    """Ranks disagree about what is communicated (tensor sizes, keys or order)."""


class RankFailed(ByteSchedulerError):
    """Another rank failed for a cause of its own (a bad argument, a bad setting); the message
    names the rank and its error. That rank raised the error itself."""


class CallbackError(ByteSchedulerError):
    """A done-callback of a task raised; the original exception is the ``__cause__``."""


class InternalError(ByteSchedulerError):
    """A programming error inside bytescheduler or its backend (a ``KeyError``, a
    ``TypeError``, ...), not a failed communication; the original exception is the
    ``__cause__``."""


# What communication backends raise when an operation fails: torch.distributed, gloo and
# NCCL a RuntimeError (DistBackendError, DistNetworkError, ...), Horovod HorovodInternalError,
# MXNet MXNetError (RuntimeErrors too), sockets an OSError (ConnectionError, TimeoutError).
_COMMUNICATION_ERRORS = (RuntimeError, OSError)
# RuntimeErrors that are programming errors.
_PROGRAMMING_ERRORS = (NotImplementedError, RecursionError)


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is what a communication backend raises for a failed operation."""
    return isinstance(error, _COMMUNICATION_ERRORS) and not isinstance(error, _PROGRAMMING_ERRORS)


def as_library_error(error: BaseException, rank: int) -> ByteSchedulerError:
    """``error`` itself when bytescheduler raised it; a :class:`CommunicationError` caused
    by it when a communication backend did (:func:`is_communication_error`: a peer died,
    the network failed); otherwise an :class:`InternalError` caused by it."""
    if isinstance(error, ByteSchedulerError):
        return error
    if is_communication_error(error):
        wrapped: ByteSchedulerError = CommunicationError(
            f"rank {rank}: communication failed ({type(error).__name__}: {error}); a peer "
            "process may have died or the network failed"
        )
    else:
        wrapped = InternalError(
            f"rank {rank}: internal error in bytescheduler (please report): {type(error).__name__}: {error}"
        )
    wrapped.__cause__ = error
    return wrapped


def copy_of(error: BaseException) -> BaseException:
    """A new exception of ``error``'s type with its arguments and attributes, chained to it.

    Built without calling the type's ``__init__`` (which may take other arguments than the
    message, so ``type(error)(str(error))`` itself could fail); when even that is not
    possible (an exception type that refuses it), ``error`` itself is returned.
    """
    kind = type(error)
    try:
        clone = kind.__new__(kind, *error.args)
        clone.args = error.args
        clone.__dict__.update(getattr(error, "__dict__", {}))
    except Exception:  # noqa: BLE001 - any refusal: raise the original instead
        return error
    clone.__cause__ = error
    return clone


def reraise(error: BaseException) -> NoReturn:
    """Raise ``error`` again on this thread: its type, its message, its traceback as the cause."""
    clone = copy_of(error)
    if clone is error:
        raise error
    raise clone from error


class ErrorLatch:
    """The first error wins; :meth:`raise_if_set` raises it (see :func:`reraise`) on any thread.

    ``raised`` tells whether it has been raised to someone, so a final ``stop()`` raises an
    error only when nobody has seen it yet.
    """

    __slots__ = ("error", "raised", "_lock")

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self.raised = False
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return self.error is not None

    def set(self, error: BaseException) -> bool:
        """Keep ``error`` if it is the first; True when it was."""
        with self._lock:
            if self.error is not None:
                return False
            self.error = error
            return True

    def raise_if_set(self) -> None:
        """Raise the kept error, if any (a copy of its type, chained to it)."""
        error = self.error
        if error is not None:
            self.raised = True
            reraise(error)
