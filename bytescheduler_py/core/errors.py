"""Exceptions raised by bytescheduler."""

from __future__ import annotations


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
